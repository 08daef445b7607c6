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
- the faults, each in a job of its own, then a healthy job: a child rank that raises, rank 0 raising, a child
  that hangs before ``fabric.launch()`` (bounded by ``rank_timeout``) and one that hangs mid-training (rank 0
  blocked in a collective, bounded by the process group's timeout); every job's child ranks gone as the next
  job starts;
- HydraDDP and HydraFSDP under torchrun, which starts every rank (hydra_fsdp starts none);
- docs/fabric.md's train.py, as a user copies it;
- and, a sweep each, SIGTERM and Ctrl-C ending a sweep whose Fabric trains or is blocked on a hung rank.
"""

import functools
import json
import re
import shutil
import statistics
import sys
import time

import pytest
from helpers import (
    APPS,
    MODEL_PARALLEL,
    MODEL_PARALLEL_REASON,
    SWEEP_TIMEOUT,
    Blocked,
    Run,
    alive,
    app_env,
    free_port,
    ok,
    run_side_by_side,
    stop,
    wait_for,
)
from shared import case_overrides, nothing_outlives

STRATEGIES = ["ddp", "fsdp", "model_parallel"]
LRS = [0.1, 0.2]
PUBLIC = {"ddp": "HydraDDP", "fsdp": "HydraFSDP", "model_parallel": "HydraModelParallel"}
CALLBACKS = [f"+hydra.callbacks.{name}._target_=__main__.{name}" for name in ("RecordStart", "RecordError")]
# the failures' sweep, a job each in this order: rank 1 killed in job 0, a rank 1 of another precision,
# and fabric.launch(fn) after both
FAILURES = {
    "killed": {"fail_rank": 1, "fail_how": "kill"},
    "precision": {"bf16_on_rank_1": True, "fail_rank": 1},
    "launch_fn": {"launch_fn": True},
}
# the faults' sweep: each case fails in a job of its own (the strategy's timeouts its own), "healthy" last
FAULTS = {
    "child_raises": {"fail_rank": 1, "fail_how": "raise"},
    "rank0_raises": {"fail_rank": 0, "fail_how": "raise"},
    "hang_before_launch": {"fail_rank": 1, "fail_how": "init_hang", "strategy.rank_timeout": 6},
    "hang_in_training": {"fail_rank": 1, "fail_how": "hang", "strategy.timeout.seconds": 5},
    "healthy": {},
}
# what each one's error says
FAULT_ERRORS = {
    "child_raises": [
        "ChildRankError: Child rank 1 failed",
        "RuntimeError: rank 1 fails on purpose at step 2",
    ],
    "rank0_raises": ["RuntimeError: rank 0 fails on purpose at step 2", "they were ended", "rank 1 (pid"],
    "hang_before_launch": ["Child rank(s) [1] did not reach the process group within 6 s", "rank_timeout"],
    "hang_in_training": ["Timed out", "child ranks were still running; they were ended", "rank 1 (pid"],
}

pytestmark = pytest.mark.skipif(not MODEL_PARALLEL, reason=MODEL_PARALLEL_REASON)


def start(app, *overrides):
    command = [sys.executable, "app.py", "-m", *overrides, *CALLBACKS]
    return Run(command, app, app_env())


def torchrun(app, *overrides):
    """The app's sweep under torchrun, 2 processes: each runs the whole sweep, one rank of every job."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    command += [f"--master-port={free_port()}", "app.py", "-m", *overrides, *CALLBACKS]
    return Run(command, app, app_env())


def copy_app(directory):
    shutil.copy(APPS / "fabric_app.py", directory / "app.py")
    return directory


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    apps = {}
    for name in ("jobs", "failures", "checkpoints", "faults", "torchrun", "docs"):
        apps[name] = copy_app(tmp_path_factory.mktemp(name))
    faults = {case: {**values, "fail_job": "${hydra:job.num}"} for case, values in FAULTS.items()}
    # docs/fabric.md's train.py, as a user would copy it
    docs = (APPS.parent.parent / "docs" / "fabric.md").read_text()
    (apps["docs"] / "app.py").write_text(
        re.search(r"^```python\n(.*?)^```", docs, re.MULTILINE | re.DOTALL).group(1)
    )
    starts = [
        functools.partial(
            start, apps["jobs"], "hydra.sweep.dir=sweep", f"strategy={','.join(STRATEGIES)}", "lr=0.1,0.2"
        ),
        # no hydra.sweep.dir: multirun/<date>/<time>
        functools.partial(start, apps["failures"], *case_overrides(apps["failures"], FAILURES)),
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
            start, apps["faults"], "hydra.sweep.dir=sweep", *case_overrides(apps["faults"], faults)
        ),
        functools.partial(torchrun, apps["torchrun"], "hydra.sweep.dir=sweep", "strategy=ddp,fsdp"),
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
    """As each job starts, the sweep's process holds no process group and no parameter, and no child rank of
    an earlier job runs: each was ended with its job, the sweep still running (the faults' jobs too)."""
    for name in ("jobs", "failures", "faults"):
        app, _ = sweeps[name]
        starts = sorted(app.rglob("start.json"))
        assert len(starts) >= 3, (name, starts)
        for start_file in starts:
            start = json.loads(start_file.read_text())
            assert start["process_group"] is False and start["parameters"] == 0, (start_file, start)
            assert start["children_alive"] == [], (start_file, start)


def fault(sweeps, case):
    """Job ``case`` of the faults' sweep: its dir, and its error (None if it did not fail)."""
    job = sweeps["faults"][0] / "sweep" / case
    return job, (job / "error.txt").read_text() if (job / "error.txt").exists() else None


@pytest.mark.parametrize("case", [case for case in FAULTS if case != "healthy"])
def test_a_failing_or_hanging_rank_fails_its_job_naming_it_and_the_sweep_goes_on(sweeps, case):
    job, error = fault(sweeps, case)
    assert error is not None, f"job {case} did not fail:\n{sweeps['faults'][1].text()[-4000:]}"
    for text in FAULT_ERRORS[case]:
        assert text in error, (text, error)
    started = sorted(path.stem for path in (job / "started").glob("rank*.json"))
    assert started == ([] if case == "hang_before_launch" else ["rank0", "rank1"]), started
    if (
        case == "hang_in_training"
    ):  # where the hung rank stood: its stack, dumped into its log before it ended
        assert "in train" in (job / "rank_1.log").read_text()
    healthy, healthy_error = fault(sweeps, "healthy")
    assert healthy_error is None and sorted(seen(healthy)) == [0, 1], healthy_error


def test_torchrun_starts_every_rank_and_hydra_fsdp_none(sweeps):
    """Each torchrun process runs the whole sweep, one rank of every job: the same two processes (no child
    rank forked) train each job together, in the job's own dir, to HydraDDP's losses of the jobs' sweep."""
    app, run = sweeps["torchrun"]
    ok(run)
    reference = seen(sweeps["jobs"][0] / "sweep" / "0")[0]["losses"]  # HydraDDP, lr 0.1
    pids = []
    for job, strategy in enumerate(("ddp", "fsdp")):
        ranks = seen(app / "sweep" / str(job))
        assert sorted(ranks) == [0, 1], run.text()[-3000:]
        for rank in ranks.values():
            assert rank["world"] == 2 and rank["output_dir"] == str(app / "sweep" / str(job)), rank
            assert rank["strategy"] == f"hydra_fsdp.fabric.{PUBLIC[strategy]}"
            assert rank["losses"] == pytest.approx(reference, rel=1e-5), (strategy, rank["losses"])
        pids.append([ranks[0]["pid"], ranks[1]["pid"]])
    assert pids[0] == pids[1] and pids[0][0] != pids[0][1], f"torchrun's two processes ran both jobs: {pids}"
    assert not list(app.rglob("rank_1.log")), "hydra_fsdp started no child rank"


def test_the_fork_server_starts_a_child_in_a_fraction_of_an_interpreters_start(sweeps):
    """Reported, not asserted (a machine's speed varies): a forked child's age as ``fabric.launch()`` returns,
    against a fresh interpreter's age once it imported torch and Lightning Fabric."""
    app, _ = sweeps["jobs"]
    ages = [json.loads(path.read_text())["age"] for path in app.glob("sweep/*/started/rank1.json")]
    assert len(ages) == len(STRATEGIES) * len(LRS)
    code = "import time, torch, lightning.fabric; print(time.time())"
    began = time.time()
    fresh = float(Run([sys.executable, "-c", code], app, app_env()).wait(60).text().split()[-1]) - began
    median = statistics.median(ages)
    print(f"a forked child rank at fabric.launch(): {median:.2f} s old (median of {len(ages)} children);")
    print(f"a fresh interpreter, torch and lightning.fabric imported: {fresh:.2f} s")


def test_a_failed_rank_fails_its_job_only_and_the_default_sweep_dir_is_one(sweeps):
    app, run = sweeps["failures"]
    sweep_dirs = [path for path in (app / "multirun").glob("*/*") if path.is_dir()]
    assert len(sweep_dirs) == 1, f"rank 1 must not start a sweep dir of its own: {sweep_dirs}"
    jobs = {path.name: path for path in sweep_dirs[0].iterdir() if path.is_dir()}
    assert sorted(jobs) == sorted(FAILURES), run.text()[-3000:]
    for what, job in jobs.items():
        error = (job / "error.txt").read_text() if (job / "error.txt").exists() else None
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
            assert sorted(seen(job)) == [0, 1]


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


@pytest.mark.parametrize(
    "how, while_",
    [("SIGTERM to the sweep alone", "blocked on a hung child"), ("SIGINT to its process group", "training")],
)
def test_stopping_a_fabric_sweep_ends_every_rank_and_the_fork_server(tmp_path, how, while_):
    app, job = copy_app(tmp_path), tmp_path / "sweep" / "0"
    if while_ == "training":  # 8 steps of a second: training still, once both ranks started
        sweep = start(app, "hydra.sweep.dir=sweep", "lr=0.1,0.2", "steps=8", "step_seconds=1")
    else:  # rank 1 sleeps in step 2: rank 0 waits in the collective, where no signal handler runs
        sweep = start(app, "hydra.sweep.dir=sweep", "lr=0.1,0.2", "fail_rank=1", "fail_how=hang")
    started = {}
    try:
        with nothing_outlives("the stopped sweep"):
            wait_for(lambda: len(list(job.glob("started/rank*.json"))) == 2, SWEEP_TIMEOUT, "job 0's 2 ranks")
            started = {p.stem: json.loads(p.read_text()) for p in job.glob("started/rank*.json")}
            if while_ == "blocked on a hung child":
                wait_for((job / "hanging" / "rank1.json").exists, SWEEP_TIMEOUT, "rank 1 to hang")
                wait_for(Blocked(started["rank0"]["pid"]), SWEEP_TIMEOUT, "rank 0 to block on the hung rank")
            stopped = time.monotonic()
            stop(sweep, how)
            sweep.wait(timeout=10)
            took = time.monotonic() - stopped
    finally:
        sweep.end()
    assert sweep.returncode != 0, sweep.text()[-6000:]
    ended = [
        started["rank0"]["pid"],
        started["rank1"]["pid"],
        started["rank1"]["ppid"],
    ]  # ppid: the fork server
    wait_for(lambda: not any(map(alive, ended)), 10, f"the ranks and the fork server {ended} to end")
    assert not (tmp_path / "sweep" / "1").exists(), (
        f"a stopped sweep started its next job:\n{sweep.text()[-6000:]}"
    )
    print(f"{how}, {while_}: the sweep exited {sweep.returncode} {took:.1f} s after the signal")
