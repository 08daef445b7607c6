"""End to end on a real SLURM: a Hydra sweep through hydra-submitit-launcher, 2 tasks per job.

SLURM (srun) starts both ranks of every job; HydraDDP/HydraFSDP spawn nothing and train with
SLURM's ranks (Lightning's SLURMEnvironment), for the Trainer and for a Fabric loop alike. The
cluster is real: munged, slurmctld and slurmd on this host (tests/slurm_cluster.py). Skipped where
SLURM or hydra-submitit-launcher is not installed, unless HYDRA_FSDP_REQUIRE_SLURM=1
(CI), which turns the skip into a failure.

Two things the app needs under submitit, whatever the strategy:
- ``_target_``s importable by the job: submitit runs each task as ``python -m
  submitit.core._submit``, where ``__main__`` is submitit, so ``__main__.Tiny`` cannot be located.
  The job runs in the submit directory, so the app's own module name works: ``app.Tiny``.
- every task resolves the job's config on its own: a ``${now:...}`` differs between ranks (the
  strategy refuses such a job), so the stamp is pinned.
"""

import importlib.util
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from helpers import (
    APPS,
    MODEL_PARALLEL,
    MODEL_PARALLEL_REASON,
    SWEPT,
    SWEPT_LRS,
    SWEPT_TARGETS,
    alive,
    assert_ranks_agree,
    copy_app,
    records,
    start_sweep,
    started_pids,
    sweep_in,
    wait_all,
    wait_for,
)
from shared import nothing_outlives
from slurm_cluster import SlurmNotInstalled, start_cluster

SLURM_SWEEP_TIMEOUT = 240  # seconds; 2 jobs, one after the other on 2 cores, take about 30 s
FAIL_FAST_BOUND = 120  # seconds within which a misconfigured job must have failed the sweep
REQUIRED = os.environ.get("HYDRA_FSDP_REQUIRE_SLURM") == "1"

# the app's own needs under submitit (see above)
APP_UNDER_SUBMITIT = ("module._target_=app.Tiny", "module.stamp=pinned")


def unavailable(reason):
    if REQUIRED:
        pytest.fail(f"HYDRA_FSDP_REQUIRE_SLURM=1, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        unavailable("hydra-submitit-launcher is not installed (pip install hydra-submitit-launcher)")
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmNotInstalled as error:  # installed but would not start: a failure, not a skip
        unavailable(str(error))
    try:
        yield cluster
    finally:
        cluster.stop()


def launcher(cluster, tasks_per_node=2):
    """The hydra-submitit-launcher settings the sweep runs with on this cluster."""
    return (
        "hydra/launcher=submitit_slurm",
        f"hydra.launcher.partition={cluster.partition}",
        "hydra.launcher.nodes=1",
        f"hydra.launcher.tasks_per_node={tasks_per_node}",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=10",
    )


def submitit_logs(app, lines=25):
    out = []
    for log in sorted((app / "sweep" / ".submitit").glob("*/*_log.*")):
        out.append(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)


def failure_report(proc, app, cluster):
    return (
        f"sweep exited {proc.returncode} after {proc.seconds:.0f} s\n{proc.stdout[-2000:]}\n"
        f"{proc.stderr[-4000:]}"
        f"\n{submitit_logs(app)}\n{cluster.logs(15)}"
    )


def task_log(app, array_task, task):
    """What SLURM task ``task`` of the job ``<array id>_<index>`` wrote to its stdout and stderr.

    (Lightning logs to stderr when it is imported before Hydra configures logging: submitit
    unpickles the task function, and with it its imports, first.)
    """
    folder = app / "sweep" / ".submitit" / array_task
    return "".join((folder / f"{array_task}_{task}_log.{stream}").read_text() for stream in ("out", "err"))


def arrays(app):
    """The ids of the array jobs the sweep in ``app`` submitted (one per sweep)."""
    return [p.name for p in (app / "sweep" / ".submitit").iterdir() if re.fullmatch(r"\d+", p.name)]


def slurm_job_ids(cluster, array_id):
    """SLURM_JOB_ID of every task of an array: {"<array id>_<index>": job id}."""
    ids = {}
    for line in cluster.run("scontrol", "show", "job", "-o", array_id).stdout.splitlines():
        task = re.search(r"\bJobId=(\d+) .*\bArrayJobId=(\d+) ArrayTaskId=(\d+)\b", line)
        if task:
            ids[f"{task[2]}_{task[3]}"] = task[1]
    return ids


@pytest.fixture(scope="module")
def slurm_sweep():
    """``slurm_sweep(app, cluster)``: the sweep of a job for each strategy, 2 tasks a job, run once
    (by the first test that asks, in its app dir); its app dir and run. (One lr: under SLURM every
    job is a task of the array on its own, so a second job of a strategy would check nothing new.)"""
    swept = []

    def sweep(app, cluster):
        if not swept:
            env = {**cluster.env, "HYDRA_FSDP_CLAIMS": str(app / "claims")}  # SLURM assigns the devices
            proc = sweep_in(app, *launcher(cluster), *APP_UNDER_SUBMITIT,
                            f"trainer.strategy._target_={SWEPT_TARGETS}", f"module.lr={SWEPT_LRS[0]}",
                            env=env, timeout=SLURM_SWEEP_TIMEOUT * len(SWEPT))  # fmt: skip
            assert proc.returncode == 0, failure_report(proc, app, cluster)
            swept.append((app, proc))
        return swept[0]

    return sweep


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_slurm_sweep_two_tasks_per_job(app, cluster, slurm_sweep, strategy):
    app, proc = slurm_sweep(app, cluster)
    array_id, *others = arrays(app)
    assert not others, f"one array job for the sweep, found {[array_id, *others]}"
    job_ids = slurm_job_ids(cluster, array_id)
    assert sorted(job_ids) == [f"{array_id}_{job}" for job in range(len(SWEPT))], job_ids
    job, lr = SWEPT.index(strategy), SWEPT_LRS[0]
    job_dir = app / "sweep" / str(job)
    seen = assert_ranks_agree(job_dir, world=2)  # ranks 0 and 1, distinct pids, one job
    assert seen[0]["lr"] == lr and seen[0]["job"] == job
    assert seen[0]["strategy"] == f"hydra_fsdp.Hydra{strategy.upper()}"
    # SLURM started both ranks: HydraDDP/HydraFSDP spawned no child and wrote no plan for one
    assert not (job_dir / "rank_1.log").exists()
    assert not (job_dir / "rank_config.pickle").exists()
    assert not (app / "claims").exists(), "under SLURM no job claims a device"
    # each SLURM task of this job was one rank
    array_task = f"{array_id}_{job}"
    for rank in (0, 1):
        log = task_log(app, array_task, rank)
        assert f"global_rank={rank}(2)" in log, log
        assert f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/2" in log, log
    # and they met where Lightning's SLURMEnvironment sends them: 15000 + the job id's last 4 digits
    expected_port = str(15000 + int(job_ids[array_task][-4:]))
    assert seen[0]["master_port"] == seen[1]["master_port"] == expected_port, (seen, job_ids)
    if strategy == "fsdp":
        held = [seen[r]["params_held"] for r in (0, 1)]
        assert sum(held) == seen[0]["params_total"] and min(held) > 0, held
    print(f"SLURM, {len(SWEPT)} jobs x 2 tasks, {SWEPT}: {proc.seconds:.1f} s")


@pytest.mark.skipif(not MODEL_PARALLEL, reason=MODEL_PARALLEL_REASON)  # as tests/test_fabric.py
def test_slurm_fabric_sweep_two_tasks_per_job(tmp_path, cluster):
    """tests/apps/fabric_app.py (a Fabric loop) under SLURM: a job of each Fabric strategy, SLURM's
    two tasks its ranks; hydra_fsdp starts none (its Data ``_target_`` importable, as above)."""
    app = tmp_path / "fabric"
    app.mkdir()
    shutil.copy(APPS / "fabric_app.py", app / "app.py")
    env = {**cluster.env, "HYDRA_FSDP_CLAIMS": str(app / "claims")}
    proc = sweep_in(app, *launcher(cluster), "data._target_=app.Data", "strategy=ddp,fsdp",
                    env=env, timeout=SLURM_SWEEP_TIMEOUT * 2)  # fmt: skip
    assert proc.returncode == 0, failure_report(proc, app, cluster)
    array_id, *others = arrays(app)
    assert not others, f"one array job for the sweep, found {[array_id, *others]}"
    job_ids = slurm_job_ids(cluster, array_id)
    for job, strategy in enumerate(("HydraDDP", "HydraFSDP")):
        job_dir = app / "sweep" / str(job)
        seen = {rank: json.loads((job_dir / "seen" / f"rank{rank}.json").read_text()) for rank in (0, 1)}
        assert [seen[r]["rank"] for r in (0, 1)] == [0, 1] and seen[0]["pid"] != seen[1]["pid"], seen
        for rank in (0, 1):
            assert seen[rank]["world"] == 2 and seen[rank]["job"] == job, seen
            assert seen[rank]["strategy"].endswith(f".{strategy}"), seen
            assert seen[rank]["data_type"] == "Data" and seen[rank]["mode"] == "Mode.CAREFUL", seen
            assert Path(seen[rank]["output_dir"]).resolve() == job_dir.resolve(), seen
        assert seen[0]["losses"] == seen[1]["losses"], seen  # all-reduced: one job, in step
        # SLURM started both ranks: hydra_fsdp wrote no plan for a child and claimed no device
        assert not (job_dir / "rank_config.pickle").exists()
        assert not (app / "claims").exists(), "under SLURM no job claims a device"
        expected_port = str(15000 + int(job_ids[f"{array_id}_{job}"][-4:]))  # SLURMEnvironment's
        assert seen[0]["master_port"] == seen[1]["master_port"] == expected_port, (seen, job_ids)
        if strategy == "HydraFSDP":
            held = [seen[r]["params_held"] for r in (0, 1)]
            assert sum(held) == 49 and min(held) > 0, held  # each rank its own shard of the 49
    print(f"SLURM, Fabric, 2 jobs x 2 tasks (HydraDDP, HydraFSDP): {proc.seconds:.1f} s")


def test_slurm_fewer_tasks_than_devices_fails_fast(app, cluster):
    proc = sweep_in(
        app,
        *launcher(cluster, tasks_per_node=1),  # the Trainer still asks for devices=2
        *APP_UNDER_SUBMITIT,
        env=cluster.env,
        timeout=FAIL_FAST_BOUND + 60,
    )
    assert proc.returncode != 0, failure_report(proc, app, cluster)
    assert proc.seconds < FAIL_FAST_BOUND, failure_report(proc, app, cluster)
    error = proc.stderr
    # hydra_fsdp's own check (_check_launched_world_size), which runs before Lightning's (its
    # SLURMEnvironment.validate_settings names --ntasks-per-node too)
    own = "RankLaunchError: The external launcher started 1 processes (world size), but the strategy expects"
    assert own in error, failure_report(proc, app, cluster)
    assert "num_nodes x devices = 1 x 2 = 2" in error, failure_report(proc, app, cluster)
    assert not records(app / "sweep" / "0")
    print(f"SLURM, tasks_per_node=1 with devices=2 failed in {proc.seconds:.1f} s")


def test_slurm_ranks_that_resolve_different_configs_fail_the_job(app, cluster):
    """Each SLURM task resolves ${now:...} itself: the stamps differ and the job is refused."""
    proc = sweep_in(
        app,
        *launcher(cluster),
        "module._target_=app.Tiny",  # the stamp left as ${now:%H-%M-%S-%f}
        env=cluster.env,
        timeout=FAIL_FAST_BOUND + 60,
    )
    assert proc.returncode != 0, failure_report(proc, app, cluster)
    assert proc.seconds < FAIL_FAST_BOUND, failure_report(proc, app, cluster)
    report = failure_report(proc, app, cluster)
    assert "RankLaunchError" in proc.stderr and "module.stamp" in proc.stderr, report
    assert not records(app / "sweep" / "0")
    print(f"SLURM, ranks with different stamps refused in {proc.seconds:.1f} s")


def running(job_dir):
    try:
        return bool(started_pids(job_dir))
    except ValueError:  # a rank is writing its file right now
        return False


@pytest.fixture(scope="module", autouse=True)
def cancelled_sweep(cluster, tmp_path_factory):
    """A sweep whose job is cancelled (scancel, as a user or a lost node would) once it runs, as the
    module starts: submitit then waits for a result that never comes (15 s) while the module's other
    tests run. (Its job's processes are up before they start: SLURM's step daemons, orphans, become
    pytest's children, which each test's leak check would take for its own.) The app dir, the
    sweep's Run and when the job was cancelled.

    Under SLURM the app reads LOCAL_RANK unset, so fail_rank=0 hangs both tasks until the cancel.
    """
    app = copy_app(tmp_path_factory.mktemp("cancelled"))
    hang = ("module.fail_rank=0", "module.fail_how=train_hang")
    with nothing_outlives("the cancelled sweep"):
        sweep = start_sweep(app, *launcher(cluster), *APP_UNDER_SUBMITIT, *hang, env=cluster.env)
        try:
            wait_for(lambda: running(app / "sweep" / "0"), SLURM_SWEEP_TIMEOUT, "the job to start")
            assert sweep.proc.poll() is None
            cluster.run("scancel", *arrays(app))
            yield app, sweep, time.monotonic()
        finally:
            sweep.end()  # where no test waited for it


def test_slurm_cancelled_job_fails_the_sweep_instead_of_hanging_it(cancelled_sweep, cluster):
    """A job SLURM ends writes no result: submitit must learn its state. It asks sacct, which needs
    an accounting database; the cluster's stand-in answers from scontrol."""
    app, sweep, cancelled = cancelled_sweep
    wait_all([sweep], timeout=cancelled - sweep.started + FAIL_FAST_BOUND)
    output = sweep.text()
    assert sweep.returncode != 0, output[-3000:]
    assert "UncompletedJobError" in output and "CANCELLED" in output, output[-3000:]
    for pid in started_pids(app / "sweep" / "0").values():
        assert not alive(pid), f"rank pid {pid} outlived its cancelled job"
    assert not cluster.jobs_left()
