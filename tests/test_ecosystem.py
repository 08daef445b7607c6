"""Both Lightning namespaces with the plain names, a plain-YAML app, and logs.

``hydra_fsdp.HydraDDP`` (in YAML and hydra-zen alike) must give each Trainer a strategy of the
Trainer's own namespace, with both packages installed and with either one alone. "Installed
alone" is checked by hiding the other package from every process of the sweep, child ranks and
fork server included (a ``sitecustomize`` that makes its import fail, as a missing package's does).
"""

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    APPS,
    SWEPT_JOBS,
    SWEPT_LR_VALUES,
    SWEPT_TARGETS,
    assert_ranks_agree,
    copy_app,
    ok,
    records,
    run_side_by_side,
    start_sweep,
    swept_jobs,
)
from shared import nothing_outlives

PYTORCH_LIGHTNING = ("pytorch_lightning", "lightning_fabric")
LIGHTNING = ("lightning", "lightning.pytorch", "lightning.fabric")


def hide(tmp_path, packages):
    """An environment in which ``packages`` cannot be imported, for every process it reaches."""
    site = tmp_path / "hidden"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in packages)
    )
    return {"PYTHONPATH": str(site)}


def assert_yaml_job(job_dir, strategy, stages=("fit", "test"), lightning="lightning.pytorch"):
    for stage in stages:
        seen = records(job_dir, stage)
        assert sorted(seen) == [0, 1], f"{stage}: ranks {sorted(seen)}"
        for rank in seen.values():
            assert rank["world"] == 2 and rank["output_dir"] == str(job_dir)
            assert rank["strategy"] == strategy
            assert rank["trainer"] == f"{lightning}.trainer.trainer"
            assert rank["datamodule"] == "ShapesData"
        assert seen[0]["lr"] == seen[1]["lr"] and seen[0]["pid"] != seen[1]["pid"]
    if "test" in stages and strategy.endswith("DDP"):  # FSDP ranks hold a shard each
        tested = records(job_dir, "test")
        assert tested[0]["weight_sum"] == tested[1]["weight_sum"]


# Which packages each run leaves importable: both, or the Trainer's own alone.
INSTALLED = ("both installed", "alone")
# Each namespace, and the other's packages: those hidden where it is installed alone.
NAMESPACES = {"lightning.pytorch": PYTORCH_LIGHTNING, "pytorch_lightning": LIGHTNING}
# The overrides of each app's sweep on each namespace: the YAML app's on lightning.pytorch runs every
# strategy x lr, fit then test, and serves the logs' test too.
OVERRIDES = {
    ("yaml", "lightning.pytorch"): (
        f"trainer.strategy._target_={SWEPT_TARGETS}",
        f"model.lr={SWEPT_LR_VALUES}",
    ),
    ("yaml", "pytorch_lightning"): ("trainer._target_=pytorch_lightning.Trainer", "test=false"),
    ("zen", "lightning.pytorch"): ("module.lr=0.1",),  # builds(HydraDDP)
    ("zen", "pytorch_lightning"): ("module.lr=0.1",),
}


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Every sweep of this module, of the YAML app and the hydra-zen one, on either namespace, with
    both packages installed or the Trainer's alone, run two at a time (they are independent, and each
    spends much of its time in one process's imports): {(app, installed, lightning): (app dir, run)}."""
    starts, keys = [], []
    for (app, lightning), overrides in OVERRIDES.items():
        for installed in INSTALLED:
            # (named for the app: Lightning formats a warning from any path that says "lightning" as its own)
            tmp = tmp_path_factory.mktemp(app)
            hidden = hide(tmp, NAMESPACES[lightning]) if installed == "alone" else {}
            if app == "yaml":
                directory, script = Path(shutil.copytree(APPS / "yaml_app", tmp / "proj")), "train.py"
            else:
                directory, script = copy_app(tmp / "app"), "app.py"
            env = {"APP_LIGHTNING": lightning, **hidden}
            starts.append(functools.partial(start_sweep, directory, *overrides, script=script, env=env))
            keys.append(((app, installed, lightning), directory))
    with nothing_outlives("this module's sweeps"):
        runs = run_side_by_side(starts, at_once=2)
    return {key: (directory, run) for (key, directory), run in zip(keys, runs)}


def yaml_jobs(proj, strategy):
    """The job dirs of one strategy ("HydraDDP") in the YAML app's sweep, with their lr."""
    return [(proj / "sweep" / str(job), lr) for job, lr in swept_jobs(strategy[len("Hydra") :].lower())]


@pytest.mark.parametrize("installed", INSTALLED)
@pytest.mark.parametrize("strategy", ["HydraDDP", "HydraFSDP"])
def test_yaml_plain_names_on_lightning_pytorch(sweeps, installed, strategy):
    proj, proc = sweeps["yaml", installed, "lightning.pytorch"]
    ok(proc)
    for job_dir, lr in yaml_jobs(proj, strategy):
        assert_yaml_job(job_dir, f"hydra_fsdp.lightning.{strategy}")
        assert records(job_dir)[1]["lr"] == lr


@pytest.mark.parametrize("installed", INSTALLED)
def test_yaml_plain_names_on_pytorch_lightning(sweeps, installed):
    proj, proc = sweeps["yaml", installed, "pytorch_lightning"]
    ok(proc)
    assert_yaml_job(
        proj / "sweep" / "0",
        "hydra_fsdp.pytorch_lightning.HydraDDP",
        stages=("fit",),
        lightning="pytorch_lightning",
    )


@pytest.mark.parametrize("installed", INSTALLED)
@pytest.mark.parametrize("lightning", NAMESPACES)
def test_hydra_zen_plain_names_on_either_namespace(sweeps, installed, lightning):
    app, proc = sweeps["zen", installed, lightning]
    ok(proc)
    seen = assert_ranks_agree(app / "sweep" / "0")
    for rank in seen.values():
        assert rank["strategy_namespace"] == rank["trainer_namespace"] == lightning


def test_child_logs_go_to_their_own_file_not_the_console(sweeps):
    proj, proc = sweeps["yaml", "both installed", "lightning.pytorch"]
    ok(proc)
    console = proc.text()
    assert console.count("rank 0 of 2: trained") == SWEPT_JOBS and "rank 1 of 2" not in console
    assert "GLOBAL_RANK: 1" not in console and "GLOBAL_RANK: 0" in console
    # rank 0's warning is shown (once in the sweep: Python shows a warning once per place, its text
    # and its source line); each child's copy is in the child's log
    assert console.count("a warning that every rank raises") == 2
    for job in map(str, range(SWEPT_JOBS)):
        job_dir = proj / "sweep" / job
        child_log = (job_dir / "rank_1.log").read_text()
        assert "rank 1 of 2: trained" in child_log and "a warning that every rank raises" in child_log
        rank0_log = (job_dir / "train.log").read_text()  # Hydra's job log: rank 0's alone
        assert "rank 0 of 2: trained" in rank0_log and "rank 1 of 2" not in rank0_log
        assert sorted(p.name for p in job_dir.glob("*.log")) == ["rank_1.log", "train.log"]


def test_no_lightning_installed_is_a_clear_error(tmp_path):
    env = {**os.environ, **hide(tmp_path, PYTORCH_LIGHTNING + LIGHTNING)}
    code = """import hydra_fsdp
for attempt in (hydra_fsdp.HydraDDP, lambda: hydra_fsdp.lightning):
    try:
        attempt()
    except ImportError as e:
        print(e)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    built, attribute = out.stdout.strip().split("\n")
    assert "neither pytorch-lightning nor lightning is installed" in built, out.stderr
    assert "pip install pytorch-lightning" in built
    assert "needs the lightning package" in attribute, out.stderr


def test_importing_hydra_fsdp_imports_no_lightning():
    code = "import sys, hydra_fsdp; print(sorted(m for m in sys.modules if 'lightning' in m))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
