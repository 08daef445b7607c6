import ctypes
import signal

import pytest
from helpers import FSDP_ON_CPU, FSDP_ON_CPU_REASON, copy_app
from shared import nothing_outlives

PR_SET_CHILD_SUBREAPER = 36


def pytest_configure(config):
    # Orphans of the processes a test started (a child rank whose parent died, a torchrun worker in a
    # session of its own) become children of pytest instead of init: the check below finds them.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # Sweeps start as from a terminal, SIGINT at its default, even where pytest was started with it
    # ignored (a background job of a shell without job control): a handler is reset by exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Under -n (pytest-xdist, --dist loadscope --no-loadscope-reorder) a free worker takes the next
# module in this order: every module, the longest first (seconds in a worker on 2 cores, the mean of
# two fresh clones' --durations=0), so that the short ones at the end even out when the two workers
# finish. A module not named here runs last.
LONGEST_FIRST = [
    "test_launcher",  # 159 on 2 cores busy with other work (its sweeps, 2 at a time)
    "test_ray",  # 81 (one run, beside other work: load average 6 on the 2 cores; where Ray is installed)
    "test_parallel_jobs",  # 70
    "test_faults",  # 65
    "test_fabric",  # 57
    "test_long_sweeps",  # 49
    "test_sweeps",  # 47
    "test_slurm",  # 47 (where SLURM is installed)
    "test_optuna",  # 45 (where hydra-optuna-sweeper is installed)
    "test_ecosystem",  # 39
    "test_checkpoints",  # 36
    "test_model_parallel",  # 35
    "test_deepspeed",  # 24 to 34 (runs alone, at load average 1 to 6; where deepspeed is installed)
    "test_config_fidelity",  # 30
    "test_external",  # 27
    "test_abort",  # 18
    "test_hydra_fsdp",  # 12
    "test_readme",  # 11
    "test_template",  # 8
    "test_rank_command",  # 7
    "test_teardown",  # 4
]


def pytest_collection_modifyitems(config, items):
    """Run the longest modules first (see above). Skip what runs HydraFSDP on the CPU where
    Lightning refuses it (tests/test_sweeps.py tests the refusal there): a test marked fsdp_cpu,
    or one parametrized with the FSDP strategy."""
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: in-module order kept
    if FSDP_ON_CPU:
        return
    skip = pytest.mark.skip(reason=FSDP_ON_CPU_REASON)
    for item in items:
        params = getattr(item, "callspec", None)
        values = params.params.values() if params else ()
        if item.get_closest_marker("fsdp_cpu") or any(value in ("fsdp", "HydraFSDP") for value in values):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Fail the test if any process it started (or an orphan of one) is still running after it.
    (A module-scoped fixture's sweep is set up before this looks: it checks itself, see shared.py.)"""
    with nothing_outlives("the test"):
        yield


@pytest.fixture
def app(tmp_path):
    """A directory holding the sweep app (app.py) and a module next to it (shapes.py)."""
    return copy_app(tmp_path)
