"""Both Lightning namespaces with the plain names, a plain-YAML app, and logs.

``hydra_fsdp.HydraDDP`` (in YAML and hydra-zen alike) must give each Trainer a strategy of the
Trainer's own namespace, with both packages installed and with either one alone. "Installed
alone" is checked by hiding the other package from every process of the sweep, child ranks and
fork server included (a ``sitecustomize`` that makes its import fail, as a missing package's does).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    APPS,
    SWEEP_TIMEOUT,
    SWEPT,
    SWEPT_LR_VALUES,
    SWEPT_LRS,
    SWEPT_TARGETS,
    app_env,
    assert_ranks_agree,
    ok,
    records,
    run,
    run_app,
    swept_jobs,
)

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


@pytest.fixture
def yaml_app(tmp_path):
    return Path(shutil.copytree(APPS / "yaml_app", tmp_path / "proj"))


def run_yaml(proj, *overrides, env=None, timeout=SWEEP_TIMEOUT):
    command = [sys.executable, "train.py", "-m", "hydra.sweep.dir=sweep", *overrides]
    return run(command, proj, app_env(env=env), timeout)


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
INSTALLED = {"both installed": (), "alone": None}


@pytest.fixture(scope="module")
def yaml_sweep(tmp_path_factory):
    """``yaml_sweep(installed)``: the YAML app's directory and its one sweep of every strategy x lr on
    lightning.pytorch, fit then test, with ``installed`` packages importable; shared by the tests
    that read it (one sweep where each strategy had one, and the logs one more)."""
    sweeps = {}

    def sweep(installed):
        if installed not in sweeps:
            tmp = tmp_path_factory.mktemp("yaml")
            proj = Path(shutil.copytree(APPS / "yaml_app", tmp / "proj"))
            env = hide(tmp, PYTORCH_LIGHTNING) if installed == "alone" else {}
            overrides = (f"trainer.strategy._target_={SWEPT_TARGETS}", f"model.lr={SWEPT_LR_VALUES}")
            sweeps[installed] = proj, ok(run_yaml(proj, *overrides, env=env))
        return sweeps[installed]

    return sweep


def yaml_jobs(proj, strategy):
    """The job dirs of one strategy ("HydraDDP") in the shared YAML sweep, with their lr."""
    return [(proj / "sweep" / str(job), lr) for job, lr in swept_jobs(strategy[len("Hydra") :].lower())]


@pytest.mark.parametrize("installed", INSTALLED)
@pytest.mark.parametrize("strategy", ["HydraDDP", "HydraFSDP"])
def test_yaml_plain_names_on_lightning_pytorch(yaml_sweep, installed, strategy):
    proj, _ = yaml_sweep(installed)
    for job_dir, lr in yaml_jobs(proj, strategy):
        assert_yaml_job(job_dir, f"hydra_fsdp.lightning.{strategy}")
        assert records(job_dir)[1]["lr"] == lr


@pytest.mark.parametrize("installed", INSTALLED)
def test_yaml_plain_names_on_pytorch_lightning(yaml_app, tmp_path, installed):
    env = {
        "APP_LIGHTNING": "pytorch_lightning",
        **(hide(tmp_path, LIGHTNING) if installed == "alone" else {}),
    }
    ok(run_yaml(yaml_app, "trainer._target_=pytorch_lightning.Trainer", "test=false", env=env))
    job = yaml_app / "sweep" / "0"
    assert_yaml_job(
        job, "hydra_fsdp.pytorch_lightning.HydraDDP", stages=("fit",), lightning="pytorch_lightning"
    )


@pytest.mark.parametrize("installed", INSTALLED)
@pytest.mark.parametrize("lightning", ["lightning.pytorch", "pytorch_lightning"])
def test_hydra_zen_plain_names_on_either_namespace(app, tmp_path, installed, lightning):
    other = PYTORCH_LIGHTNING if lightning == "lightning.pytorch" else LIGHTNING
    env = {"APP_LIGHTNING": lightning, **(hide(tmp_path, other) if installed == "alone" else {})}
    ok(run_app(app, "hydra.sweep.dir=sweep", "module.lr=0.1", env=env))  # builds(HydraDDP)
    seen = assert_ranks_agree(app / "sweep" / "0")
    for rank in seen.values():
        assert rank["strategy_namespace"] == rank["trainer_namespace"] == lightning


def test_child_logs_go_to_their_own_file_not_the_console(yaml_sweep):
    proj, proc = yaml_sweep("both installed")
    console, jobs = proc.text(), len(SWEPT) * len(SWEPT_LRS)
    assert console.count("rank 0 of 2: trained") == jobs and "rank 1 of 2" not in console
    assert "GLOBAL_RANK: 1" not in console and "GLOBAL_RANK: 0" in console
    # rank 0's warning is shown (once in the sweep: Python shows a warning once per place, its text
    # and its source line); each child's copy is in the child's log
    assert console.count("a warning that every rank raises") == 2
    for job in map(str, range(jobs)):
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
