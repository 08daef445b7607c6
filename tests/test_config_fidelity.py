"""Every rank's task function gets rank 0's config, types and flags included: real sweeps (2 jobs x 2
CPU ranks) of the config shapes of Hydra's structured-config tutorials and hydra-zen's
(tests/apps/typed_app), with ``hydra.output_subdir=null``, and with custom resolvers."""

import json
import shutil
import sys

import omegaconf
import pytest
from helpers import APPS, FAULT_BOUND, FSDP_ON_CPU, app_env, ok, run_side_by_side
from helpers import Run as Started

# shape, strategy, overrides, the two jobs' values: every rank of a job must have seen them
SWEEPS = {
    "dataclass_ddp": ("dataclass", "ddp", ["optim.lr=0.1,0.3"], "lr", [0.1, 0.3]),
    "dataclass_fsdp_fast": ("dataclass", "fsdp", ["mode=fast", "optim.lr=0.1,0.3"], "lr", [0.1, 0.3]),
    "yaml_schema_no_subdir": (
        "yaml",
        "ddp",
        ["hydra.output_subdir=null", "sizes.width=4,6"],
        "width",
        [4, 6],
    ),
    "zen_fsdp": ("zen", "fsdp", ["width=4,6"], "width", [4, 6]),
}
if not FSDP_ON_CPU:
    SWEEPS = {name: sweep for name, sweep in SWEEPS.items() if sweep[1] != "fsdp"}
RESOLVERS = {"import": "with use_cache=True", "main": 'not in its `if __name__ == "__main__":` block'}
DATACLASS_NODES = {
    "optim": "Optim",
    "mode": "Mode",
    "seed": "NoneType",
    "sizes": "dict",
    "steps": "float",
    "run_id": "str",
    "devices": "int",
    "kernel": "list" if omegaconf.__version__.startswith("2.3") else "tuple",  # 2.4's TupleConfig
}


def start(app, name, shape, strategy, *overrides, resolver=""):
    env = {"APP_SHAPE": shape, "APP_RESOLVER": resolver}
    command = [sys.executable, "typed_app.py", "-m", f"hydra.sweep.dir={name}", *overrides]
    return lambda: Started(command, app, app_env(strategy, env))


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Every sweep of this module, two at a time: {name: (its Run, its sweep dir)}."""
    app = tmp_path_factory.mktemp("typed") / "app"
    shutil.copytree(APPS / "typed_app", app)
    starts = {
        name: start(app, name, shape, strategy, *overrides)
        for name, (shape, strategy, overrides, *_) in SWEEPS.items()
    }
    for resolver in RESOLVERS:
        starts[f"resolver_{resolver}"] = start(
            app,
            f"resolver_{resolver}",
            "dataclass",
            "ddp",
            "run_id=${run_id:}",
            "seed=1,2",
            resolver=resolver,
        )
    runs = run_side_by_side(list(starts.values()), at_once=2)
    return {name: (run, app / name) for name, run in zip(starts, runs)}


def seen(job_dir):
    return {rank: json.loads((job_dir / "seen" / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.parametrize("name", list(SWEEPS))
def test_every_rank_gets_rank0s_config_types_and_flags(sweeps, name):
    shape, _, overrides, key, values = SWEEPS[name]
    run, sweep = sweeps[name]
    ok(run)
    for job, value in enumerate(values):
        ranks = seen(sweep / str(job))
        assert ranks[0] == {**ranks[1], "rank": 0}, f"job {job}: rank 0 {ranks[0]}, rank 1 {ranks[1]}"
        assert ranks[1][key] == value and ranks[1]["job"] == job and ranks[1]["struct"] is True
        assert ranks[1]["kernel"] == ([] if shape == "zen" else [3, 3])
        assert ranks[1]["config type"] == "Config"  # a dataclass, never a dict
        if shape == "zen":  # hydra-zen's make_config/builds, dataclasses made at run time
            assert ranks[1]["node types"] == {"optim": "PartialBuilds_SGD", "width": "int", "devices": "int"}
        else:
            assert ranks[1]["node types"] == DATACLASS_NODES
            assert ranks[1]["callbacks"] == (
                [] if "mode=fast" in overrides else ["Timer"]
            )  # Mode.slow's branch
        assert ranks[1]["hydra dir"] is ("hydra.output_subdir=null" not in overrides)
        assert not (sweep / str(job) / "rank_config.pickle").exists()  # the job's end removed it
        if "hydra.output_subdir=null" in overrides:
            assert sorted(p.name for p in (sweep / str(job)).iterdir()) == [
                "rank_1.log",
                "seen",
                "typed_app.log",
            ]


@pytest.mark.parametrize("resolver", list(RESOLVERS))
def test_a_resolver_that_differs_on_a_child_fails_the_job_fast_naming_the_fix(sweeps, resolver):
    run, sweep = sweeps[f"resolver_{resolver}"]
    assert run.returncode != 0
    text = run.text()
    assert "The job's config value run_id: '${run_id:}' resolves to" in text, text[-4000:]
    assert RESOLVERS[resolver] in text and "'run_id'" in text
    assert not (sweep / "0" / "seen" / "rank1.json").exists()  # it failed before its task function
    assert run.seconds < FAULT_BOUND
