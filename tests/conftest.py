import ctypes
import signal
from pathlib import Path

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
# module in this order: every module, the longest first, so that the short ones at the end even out
# when the two workers finish. The seconds: a module's sweeps (its fixture's setup) plus its slowest
# tests, from one run of the README's command on 2 cores (2026-12-07: 946 s in all, 1666 s of CPU);
# Ray's and Optuna's (run apart, where the sweepers extra is installed) from earlier runs. A module not
# named here runs last.
LONGEST_FIRST = [
    "test_parallel_jobs",  # 270 (247 of them the sweeps under joblib and submitit_local)
    "test_launcher",  # 200
    "test_faults",  # 200 (signals and faults, a sweep each)
    "test_slurm",  # 180 (where SLURM is installed)
    "test_fabric",  # 150
    "test_checkpoints",  # 115
    "test_long_sweeps",  # 110
    "test_sweeps",  # 110
    "test_ecosystem",  # 100
    "test_model_parallel",  # 100
    "test_ray",  # 81 (where Ray is installed)
    "test_external",  # 90
    "test_hydra_launcher_suites",  # 90 (Hydra's launcher suites: 11 apps run with -m, 60 of them; 9 sweeps)
    "test_config_fidelity",  # 75
    "test_optuna",  # 70 (where hydra-optuna-sweeper is installed)
    "test_abort",  # 60
    "test_deepspeed",  # 50 (where deepspeed is installed)
    "test_hydra_fsdp",  # 40
    "test_readme",  # 35
    "test_template",  # 30
    "test_rank_command",  # 30
    "test_execution_policy",  # 20
    "test_teardown",  # 10
]


# The README's test command runs the unit tests and the end-to-end modules that cover each kind of
# app and sweep once (DDP and FSDP sweeps and their bad input, hydra-zen and both namespaces, typed
# configs, the launcher, the template, the README's code): about 5 minutes on 2 cores. These modules
# test at length, each a minute or more of CPU, and are marked `full`: they run where asked (`-m full`),
# as CI does after the README's command, or where named (`pytest tests/test_faults.py`). Optuna's and
# Ray's are not marked: they skip where the sweepers extra is not installed, and CI runs them where it is.
FULL = {
    "test_parallel_jobs",
    "test_faults",
    "test_slurm",
    "test_fabric",
    "test_checkpoints",
    "test_long_sweeps",
    "test_model_parallel",
    "test_external",
    "test_abort",
    "test_deepspeed",
    "test_rank_command",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(config, items):
    """Mark the modules of FULL; run the longest modules first (see above). Skip what runs HydraFSDP
    on the CPU where Lightning refuses it (tests/test_sweeps.py tests the refusal there): a test
    marked fsdp_cpu, or one parametrized with the FSDP strategy."""
    named = {Path(arg.split("::")[0]).stem for arg in config.args}
    for item in items:
        if item.path.stem in FULL and item.path.stem not in named:
            item.add_marker(pytest.mark.full)
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
