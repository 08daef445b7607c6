"""Lightning Fabric under Hydra: ``fabric.launch()`` in a sweep runs every rank of every job right.

tests/apps/fabric_app.py is a hydra-zen app, ``builds(Fabric, strategy=builds(hydra_fsdp.fabric.HydraDDP))``,
with its own training loop. Two real sweeps, side by side, 2 CPU ranks a job:

- the jobs: HydraDDP, HydraFSDP and HydraModelParallel (FSDP2) x two learning rates, each rank recording
  what it saw (config values and types, output dir, cwd, world size, pid, parameters held, losses);
- the failures, in Hydra's default timestamped sweep dir: rank 1 killed mid-training in job 0 (the rest of
  the sweep runs on), rank 1 building a Fabric of another precision (the job fails at launch, naming it),
  and ``fabric.launch(fn)``;
- the checkpoints: for HydraDDP and HydraFSDP (sharded, Fabric's default, and full), a job ``fabric.save``-s
  its model and optimizer after 2 steps, and the sweep's next job ``fabric.load``-s them and trains 2 more;
- and docs/fabric.md's train.py, as a user copies it.
"""

import functools
import json
import re
import shutil
import sys

import pytest
from helpers import APPS, MODEL_PARALLEL, MODEL_PARALLEL_REASON, Run, app_env, ok, run_side_by_side
from shared import nothing_outlives

STRATEGIES = ["ddp", "fsdp", "model_parallel"]
LRS = [0.1, 0.2]
PUBLIC = {"ddp": "HydraDDP", "fsdp": "HydraFSDP", "model_parallel": "HydraModelParallel"}
CALLBACKS = [f"+hydra.callbacks.{name}._target_=__main__.{name}" for name in ("RecordStart", "RecordError")]
# jobs of the failures' sweep, in Hydra's order (launch_fn, then bf16_on_rank_1)
FAILURES = {0: "killed", 1: "precision", 2: "launch(fn)", 3: "precision"}

pytestmark = pytest.mark.skipif(not MODEL_PARALLEL, reason=MODEL_PARALLEL_REASON)


def start(app, *overrides):
    command = [sys.executable, "app.py", "-m", *overrides, *CALLBACKS]
    return Run(command, app, app_env())


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    apps = {}
    for name in ("jobs", "failures", "checkpoints", "docs"):
        apps[name] = tmp_path_factory.mktemp(name)
        shutil.copy(APPS / "fabric_app.py", apps[name] / "app.py")
    # docs/fabric.md's train.py, as a user would copy it
    docs = (APPS.parent.parent / "docs" / "fabric.md").read_text()
    (apps["docs"] / "app.py").write_text(
        re.search(r"^```python\n(.*?)^```", docs, re.MULTILINE | re.DOTALL).group(1)
    )
    failures = ("launch_fn=false,true", "bf16_on_rank_1=false,true", "fail_rank=1", "fail_how=kill")
    starts = [
        functools.partial(
            start, apps["jobs"], "hydra.sweep.dir=sweep", f"strategy={','.join(STRATEGIES)}", "lr=0.1,0.2"
        ),
        functools.partial(start, apps["failures"], *failures),  # no hydra.sweep.dir: multirun/<date>/<time>
        # each strategy: a job saves after 2 steps, the next loads that and trains 2 more
        functools.partial(
            start,
            apps["checkpoints"],
            "hydra.sweep.dir=sweep",
            "strategy=ddp,fsdp,fsdp_full",
            "phase=save,load",
            "steps=2",
        ),
        functools.partial(
            Run,
            [sys.executable, "app.py", "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2"],
            apps["docs"],
            app_env(),
        ),
    ]
    with nothing_outlives("this module's sweeps"):
        runs = run_side_by_side(starts, at_once=2)
    return {name: (apps[name], run) for name, run in zip(apps, runs)}


def seen(job_dir):
    return {
        int(p.stem[len("rank") :]): json.loads(p.read_text()) for p in (job_dir / "seen").glob("rank*.json")
    }


def test_every_rank_of_every_job_runs_its_own_job(sweeps):
    app, run = sweeps["jobs"]
    assert run.returncode == 0, run.text()[-6000:]
    jobs = [(strategy, lr) for strategy in STRATEGIES for lr in LRS]
    child_pids = set()
    for job, (strategy, lr) in enumerate(jobs):
        job_dir = app / "sweep" / str(job)
        ranks = seen(job_dir)
        assert sorted(ranks) == [0, 1], (job, run.text()[-3000:])
        for rank in ranks.values():
            assert rank["job"] == job and rank["world"] == 2
            assert rank["lr"] == lr and rank["lr_type"] == "float"
            assert rank["data_type"] == "Data" and rank["mode"] == "Mode.CAREFUL", rank  # the config's types
            assert rank["output_dir"] == str(job_dir) and rank["cwd"] == str(app)
            assert rank["strategy"] == f"hydra_fsdp.fabric.{PUBLIC[strategy]}"
        assert ranks[0]["pid"] == json.loads((job_dir / "start.json").read_text())["pid"], "rank 0: the sweep"
        child_pids.add(ranks[1]["pid"])
        held = [ranks[0]["params_held"], ranks[1]["params_held"]]
        if strategy == "ddp":
            assert held == [49, 49]
        else:  # each rank its own shard
            assert sum(held) == 49 and max(held) < 49, (strategy, held)
        # the config the strategy was built from names it as a YAML config would
        target = (job_dir / ".hydra" / "config.yaml").read_text()
        assert "_target_: hydra_fsdp.fabric.Hydra" in target
    assert len(child_pids) == len(jobs), "each job started its own child rank"
    # one seed: every strategy ends each lr at the same losses, on every rank
    for lr in LRS:
        losses = {
            strategy: [
                rank["losses"] for rank in seen(app / "sweep" / str(jobs.index((strategy, lr)))).values()
            ]
            for strategy in STRATEGIES
        }
        reference = losses["ddp"][0]
        for strategy, by_rank in losses.items():
            for rank_losses in by_rank:
                assert rank_losses == pytest.approx(reference, rel=1e-5), (lr, strategy, losses)


def test_the_sweep_process_keeps_nothing_of_a_finished_job(sweeps):
    for name in ("jobs", "failures"):
        app, _ = sweeps[name]
        for start_file in sorted(app.rglob("start.json")):
            start = json.loads(start_file.read_text())
            assert start["process_group"] is False and start["parameters"] == 0, (start_file, start)


def test_a_failed_rank_fails_its_job_only_and_the_default_sweep_dir_is_one(sweeps):
    app, run = sweeps["failures"]
    sweep_dirs = [path for path in (app / "multirun").glob("*/*") if path.is_dir()]
    assert len(sweep_dirs) == 1, f"rank 1 must not start a sweep dir of its own: {sweep_dirs}"
    jobs = {int(path.name): path for path in sweep_dirs[0].iterdir() if path.name.isdigit()}
    assert sorted(jobs) == sorted(FAILURES), run.text()[-3000:]
    for job, what in FAILURES.items():
        error = (jobs[job] / "error.txt").read_text() if (jobs[job] / "error.txt").exists() else None
        if what == "killed":  # rank 1's death is the job's error, not rank 0's broken collective
            assert error.startswith("ChildRankError: Child rank 1 failed"), error
            assert "killed by SIGKILL" in error and "caused by: RuntimeError" in error, error
        elif what == "precision":
            assert error.startswith("RankLaunchError: The ranks of this job are about to run different"), (
                error
            )
            assert "different things in fabric.launch()" in error, error
            assert "precision: rank 0 'Precision 32-true', rank 1 'MixedPrecision bf16-mixed'" in error, error
        else:  # fabric.launch(fn), after the failed jobs: both ranks trained
            assert error is None, error
            assert sorted(seen(jobs[job])) == [0, 1]


def test_the_docs_train_py_sweeps(sweeps):
    app, run = sweeps["docs"]
    ok(run)
    for job in ("0", "1"):
        log = (app / "sweep" / job / "rank_1.log").read_text()
        assert "GLOBAL_RANK: 1, MEMBER: 2/2" in log and "Traceback" not in log, log[-3000:]


def test_a_later_job_loads_what_an_earlier_job_saved(sweeps):
    """The job that loaded goes on where the job that saved stopped: its 2 steps are steps 3 and 4 of the
    same strategy's uninterrupted 4 steps (the jobs' sweep, lr 0.1), on every rank."""
    app, run = sweeps["checkpoints"]
    assert run.returncode == 0, run.text()[-6000:]
    jobs_app, _ = sweeps["jobs"]
    for number, strategy in enumerate(("ddp", "fsdp", "fsdp_full")):
        # HydraFSDP's uninterrupted run: the same, whatever the checkpoint holds
        uninterrupted_job = STRATEGIES.index(strategy.removesuffix("_full")) * len(LRS)
        uninterrupted = seen(jobs_app / "sweep" / str(uninterrupted_job))[0]["losses"]
        saved, loaded = seen(app / "sweep" / str(2 * number)), seen(app / "sweep" / str(2 * number + 1))
        checkpoint = app / "sweep" / f"checkpoint_{strategy}"
        # HydraFSDP's sharded state: a folder of every rank's shards; HydraDDP's and a full state: a file
        assert checkpoint.is_dir() if strategy == "fsdp" else checkpoint.is_file(), strategy
        for rank in (0, 1):
            assert saved[rank]["losses"] == pytest.approx(uninterrupted[:2], rel=1e-6), strategy
            assert loaded[rank]["losses"] == pytest.approx(uninterrupted[2:], rel=1e-5), strategy
            assert loaded[rank]["losses"] != pytest.approx(uninterrupted[:2], rel=1e-3), "it loaded nothing"
