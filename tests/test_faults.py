"""Faults and soak: a failing rank fails its job, never the sweep; nothing hangs, nothing is left."""

import os
import signal
import time

import pytest
from helpers import (
    FAULT_BOUND,
    SWEEP_TIMEOUT,
    alive,
    assert_failed_job_then_healthy_job,
    assert_ranks_agree,
    copy_app,
    ok,
    records,
    start_sweep,
    started_pids,
    sweep_in,
    wait_for,
)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("how", ["train_raise", "train_kill"])
def test_child_rank_failure_fails_its_job_not_the_sweep(app, strategy, how):
    proc = sweep_in(
        app, "module.lr=0.1,0.2", "module.fail_rank=1", f"module.fail_how={how}", strategy=strategy
    )
    log = app / "sweep" / "0" / "rank_1.log"
    code = "exit code 1" if how == "train_raise" else "exit code -9 (killed by SIGKILL)"
    expected = ["Child rank 1 failed", code, str(log)]
    if how == "train_raise":
        expected.append("ValueError: injected failure on rank 1")  # the child's own traceback, quoted
    assert_failed_job_then_healthy_job(app, proc, 1, expect_in_error=expected)
    print(f"{strategy} {how}: sweep of 2 jobs took {proc.seconds:.1f} s")


def test_child_rank_failure_while_starting_fails_fast(app):
    proc = sweep_in(app, "module.lr=0.1,0.2", "module.fail_rank=1", "module.fail_how=init_raise")
    assert_failed_job_then_healthy_job(
        app, proc, 1, expect_in_error=["Child rank 1 failed", "exit code 1", "injected failure on rank 1"]
    )


def test_child_failing_after_rank0_finished_still_fails_its_job(app):
    # rank 1 fails in its last stage's final hook, after the last collective rank 0 takes part in
    proc = sweep_in(app, "module.lr=0.1,0.2", "module.fail_rank=1", "module.fail_how=end_raise")
    assert proc.returncode != 0
    assert "Child rank 1 failed" in proc.text() and "injected failure on rank 1" in proc.text()
    assert records(app / "sweep" / "0")[0], "rank 0 finished job 0"
    assert_ranks_agree(app / "sweep" / "1")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rank0_failure_ends_its_children(app, strategy):
    proc = sweep_in(
        app, "module.lr=0.1,0.2", "module.fail_rank=0", "module.fail_how=train_raise", strategy=strategy
    )
    assert proc.returncode != 0
    assert "ValueError: injected failure on rank 0" in proc.text()
    assert not records(app / "sweep" / "0")
    assert_ranks_agree(app / "sweep" / "1")
    for job in ("0", "1"):
        for rank, pid in started_pids(app / "sweep" / job).items():
            assert not alive(pid), f"job {job} rank {rank} (pid {pid}) is still running"


def test_child_hanging_before_rendezvous_is_bounded_by_rank_timeout(app):
    proc = sweep_in(
        app,
        "module.lr=0.1,0.2",
        "module.fail_rank=1",
        "module.fail_how=init_hang",
        "trainer.strategy.rank_timeout=8",
    )
    assert_failed_job_then_healthy_job(
        app, proc, 1, expect_in_error=["[1] did not reach the process group within 8 s", "rank_timeout"]
    )


def test_child_dying_in_the_rendezvous_fails_its_job_and_leaves_the_next_one_whole(app):
    # rank 0 waits in init_process_group for a child that died there, until the group's timeout;
    # that failed init must not leave rank 0 naming the next job's process group differently
    proc = sweep_in(
        app,
        "module.lr=0.1,0.2",
        "module.fail_rank=1",
        "module.fail_how=rendezvous_kill",
        "+trainer.strategy.timeout={_target_:datetime.timedelta,seconds:5}",
    )
    assert_failed_job_then_healthy_job(
        app, proc, 1, expect_in_error=["Child rank 1 failed", "exit code -9 (killed by SIGKILL)"]
    )


# Imported at start-up by every Python process given this directory in PYTHONPATH: it makes the
# sweep's first fork server hang before it imports anything, as on a stuck file system.
HANG_FIRST_FORK_SERVER = """
import os, pathlib, time
if "HYDRA_FSDP_FORK_SERVER" in os.environ:
    hung = pathlib.Path(__file__).with_name("hung")
    if not hung.exists():
        hung.touch()
        time.sleep(3600)
"""


def test_fork_server_hanging_in_its_imports_is_bounded_by_rank_timeout(app, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANG_FIRST_FORK_SERVER)
    # job 1's fresh server gets 60 s: its imports, on a machine busy with other tests, may take 8
    proc = sweep_in(app, "trainer.strategy.rank_timeout=8,60", env={"PYTHONPATH": str(hook)})
    assert (hook / "hung").exists(), "the first fork server ran the hook"
    assert_failed_job_then_healthy_job(
        app,
        proc,
        1,
        expect_in_error=["hydra_fsdp's fork server (pid", "started none within 8 s and was ended"],
    )


def test_child_hanging_in_training_is_bounded_by_the_process_group_timeout(app):
    proc = sweep_in(
        app,
        "module.lr=0.1,0.2",
        "module.fail_rank=1",
        "module.fail_how=train_hang",
        "+trainer.strategy.timeout={_target_:datetime.timedelta,seconds:5}",
    )
    log = app / "sweep" / "0" / "rank_1.log"
    assert_failed_job_then_healthy_job(
        app,
        proc,
        1,
        expect_in_error=["Timed out", "child ranks were still running", "rank 1 (pid", f"its log is {log}"],
    )
    # the log shows where the hung rank stood: its stack, dumped before it was ended
    assert "in _maybe_fail" in log.read_text()


def stop(sweep, how):
    if how == "SIGINT to its process group":  # what Ctrl-C in a terminal does
        os.killpg(sweep.pid, signal.SIGINT)
    else:
        sweep.proc.send_signal(signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGKILL)


@pytest.mark.parametrize(
    "how", ["SIGTERM to the sweep alone", "SIGINT to its process group", "SIGKILL to the sweep"]
)
@pytest.mark.parametrize("while_", ["training", "blocked on a hung child"])
def test_stopping_the_sweep_ends_every_rank(app, how, while_):
    job = app / "sweep" / "0"
    if while_ == "training":
        # 4 steps of 2 s: still training when the signal comes, as soon as both ranks began a step
        sweep = start_sweep(app, "module.lr=0.1,0.2", env={"APP_SLOW_STEPS": "2"})
        into = [job / "steps" / "rank0_0", job / "steps" / "rank1_0"], 0.5
    else:  # rank 0 waits in a collective for rank 1, which never comes: no signal handler can run
        sweep = start_sweep(app, "module.lr=0.1,0.2", "module.fail_rank=1", "module.fail_how=train_hang")
        into = [job / "steps" / "rank0_2", job / "steps" / "rank1_2"], 1  # rank 1 hangs in its step 2
    try:
        wait_for(lambda: len(started_pids(job)) == 2, SWEEP_TIMEOUT, "both ranks of job 0 to start")
        wait_for(lambda: all(step.exists() for step in into[0]), SWEEP_TIMEOUT, f"{into[0]} to begin")
        time.sleep(into[1])  # into the step, or into rank 0's wait on the hung rank
        stopped = time.monotonic()
        stop(sweep, how)
        sweep.wait(timeout=10 if how != "SIGKILL to the sweep" else FAULT_BOUND)
        took = time.monotonic() - stopped
    finally:
        sweep.end()
    assert sweep.returncode != 0, sweep.text()[-6000:]
    pids = started_pids(job)
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), 10, f"every rank of job 0 {pids} to end")
    assert not (app / "sweep" / "1").exists(), (
        f"a stopped sweep must not start its next job:\n{sweep.text()[-8000:]}"
    )
    print(
        f"{how}, {while_}: the sweep exited {sweep.returncode} {took:.1f} s after the signal, rank 1 with it"
    )


def test_a_sweep_that_ignores_sigint_ignores_it_on_every_rank(app):
    # a fresh child would inherit rank 0's ignored SIGINT; a forked one must not die of it either
    sweep = start_sweep(app, "module.lr=0.1,0.2", env={"APP_SLOW_STEPS": "0.5"}, sigint_ignored=True)
    try:
        wait_for(
            lambda: len(started_pids(app / "sweep" / "0")) == 2, SWEEP_TIMEOUT, "both ranks of job 0 to start"
        )
        os.killpg(sweep.pid, signal.SIGINT)
        ok(sweep.wait(timeout=SWEEP_TIMEOUT))
    finally:
        sweep.end()
    for job in ("0", "1"):
        assert_ranks_agree(app / "sweep" / job)


# --------------------------------------------------------------------------- soak


@pytest.mark.slow
def test_soak_sixteen_jobs(app):
    lrs = ",".join(str(i / 100) for i in range(1, 17))
    proc = ok(sweep_in(app, f"module.lr={lrs}", timeout=900))
    ports = set()
    for job in range(16):
        seen = assert_ranks_agree(app / "sweep" / str(job))
        assert seen[0]["lr"] == (job + 1) / 100 and seen[1]["job"] == job
        ports.add(seen[1]["master_port"])
        assert all(not alive(pid) for pid in started_pids(app / "sweep" / str(job)).values())
    assert len(ports) == 16
    print(f"16 jobs x 2 ranks: {proc.seconds:.1f} s")


@pytest.mark.slow
def test_soak_two_sweeps_at_once_on_one_machine(tmp_path):
    apps = [copy_app(tmp_path / name) for name in ("a", "b")]
    lrs = ",".join(str(i / 100) for i in range(1, 9))
    started = time.monotonic()
    sweeps = [start_sweep(app_dir, f"module.lr={lrs}") for app_dir in apps]
    for sweep in sweeps:
        ok(sweep.wait(timeout=900))
    ports = set()
    for app_dir in apps:
        for job in range(8):
            seen = assert_ranks_agree(app_dir / "sweep" / str(job))
            ports.add(seen[1]["master_port"])
    assert len(ports) == 16, "no two jobs of the two sweeps may share a port"
    print(f"2 concurrent sweeps of 8 jobs x 2 ranks: {time.monotonic() - started:.1f} s")
