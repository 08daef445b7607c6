"""Faults: a failing rank fails its job, never the sweep; nothing hangs, nothing is left."""

import json
import os
import signal
import time

import pytest
from helpers import (
    FAULT_BOUND,
    FSDP_ON_CPU,
    RECORD_ALIVE,
    SWEEP_TIMEOUT,
    Blocked,
    alive,
    assert_ended_with_their_job,
    assert_every_rank_shut_down_gracefully,
    assert_failed_job_then_healthy_job,
    assert_ranks_agree,
    copy_app,
    descendants,
    ok,
    records,
    start_sweep,
    started_pids,
    stop,
    sweep_in,
    wait_all,
    wait_for,
)
from shared import case_overrides, nothing_outlives

# One sweep serves the tests of a job that fails and the healthy job after it: each scenario is a
# case (see shared.py) that fails in its own job, followed by a healthy case "<name>_next" with the
# same strategy and timeouts (its trainer.* settings), each in <sweep>/<case>. At its end Hydra
# prints its first failed job's error alone: the app's RecordError writes each one's to its error.txt.
STRATEGIES = ("ddp", {}), ("fsdp", {"trainer.strategy._target_": "hydra_fsdp.HydraFSDP"})  # the app's: DDP
GROUP_TIMEOUT = {"trainer.strategy.timeout.seconds": 5}  # the process group's
FAILING = {
    **{
        f"{how}_{strategy}": {"module.fail_rank": 1, "module.fail_how": how, **settings}
        for strategy, settings in STRATEGIES
        for how in ("train_raise", "train_kill")
    },
    "init_raise": {"module.fail_rank": 1, "module.fail_how": "init_raise"},
    # rank 1 fails in its last stage's final hook, after the last collective rank 0 takes part in
    "end_raise": {"module.fail_rank": 1, "module.fail_how": "end_raise"},
    **{
        f"rank0_{strategy}": {"module.fail_rank": 0, "module.fail_how": "train_raise", **settings}
        for strategy, settings in STRATEGIES
    },
    "init_hang": {"module.fail_rank": 1, "module.fail_how": "init_hang", "trainer.strategy.rank_timeout": 8},
    # rank 0 waits in init_process_group for a child that died there (torch's default timeout, 30
    # minutes); that failed init must not leave rank 0 naming the next job's process group differently
    "rendezvous_kill": {"module.fail_rank": 1, "module.fail_how": "rendezvous_kill"},
    "train_hang": {"module.fail_rank": 1, "module.fail_how": "train_hang", **GROUP_TIMEOUT},
    # rank 0 alone builds an EarlyStopping callback, which would deadlock the ranks, and its module's
    # parameters are float64 (as an earlier job's torch.set_default_dtype leaves rank 0, the sweep's)
    **{
        f"mismatch_{strategy}": {
            "rank0_callback": True,
            "module.fail_rank": 0,
            "module.fail_how": "init_float64",
            **settings,
        }
        for strategy, settings in STRATEGIES
    },
}
if not FSDP_ON_CPU:  # Lightning refuses FSDP on the CPU: the FSDP tests skip (conftest.py)
    FAILING = {case: settings for case, settings in FAILING.items() if not case.endswith("fsdp")}
FIRST = next(iter(FAILING))


@pytest.fixture(scope="module", autouse=True)
def failing_sweep_started(tmp_path_factory):
    """The one sweep of every FAILING case, each followed by its healthy one, started as the module
    starts: it spends most of its time waiting out timeouts, in which the module's other tests run
    (the tests that read it come last, see failing_sweep). Its app dir and Run."""
    app = copy_app(tmp_path_factory.mktemp("failing"))
    cases = {}
    for case, settings in FAILING.items():
        cases[case] = {**settings, "module.fail_job": "${hydra:job.num}"}  # fails in its own job
        cases[f"{case}_next"] = {key: value for key, value in settings.items() if key.startswith("trainer.")}
    record_errors = "+hydra.callbacks.record_error._target_=__main__.RecordError"
    with nothing_outlives("the failing sweep"):
        sweep = start_sweep(app, *case_overrides(app / "conf", cases), record_errors, RECORD_ALIVE)
        yield app, sweep
        sweep.end()  # where no test waited for it


@pytest.fixture(scope="module")
def failing_sweep(failing_sweep_started):
    """The failing sweep's app dir and run, once it ended (within SWEEP_TIMEOUT of its start)."""
    app, sweep = failing_sweep_started
    wait_all([sweep])
    return app, sweep


def error_of(failing_sweep, case):
    """Job ``case``'s error, as Hydra prints a failed job's; for the sweep's first failed job, the
    sweep's output too (where Hydra printed it)."""
    app, proc = failing_sweep
    error = (app / "sweep" / case / "error.txt").read_text()
    return error + proc.text() if case == FIRST else error


def assert_failed_then_healthy(failing_sweep, case, failed_rank, expect_in_error):
    app, proc = failing_sweep
    if case == FIRST:  # Hydra printed this one's error, as the sweep's first
        for text in expect_in_error:
            assert text in proc.text(), f"{text!r} not in the sweep's output:\n{proc.text()[-6000:]}"
    assert_failed_job_then_healthy_job(
        app,
        proc,
        failed_rank,
        expect_in_error=expect_in_error,
        failed=case,
        healthy=f"{case}_next",
        error=error_of(failing_sweep, case),
        first_of_sweep=case == FIRST,
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
    proc = sweep_in(app, "trainer.strategy.rank_timeout=8,60", RECORD_ALIVE, env={"PYTHONPATH": str(hook)})
    assert (hook / "hung").exists(), "the first fork server ran the hook"
    assert_failed_job_then_healthy_job(
        app,
        proc,
        1,
        expect_in_error=["hydra_fsdp's fork server (pid", "started none within 8 s and was ended"],
    )


@pytest.mark.parametrize(
    "how", ["SIGTERM to the sweep alone", "SIGINT to its process group", "SIGKILL to the sweep"]
)
@pytest.mark.parametrize("while_", ["training", "blocked on a hung child"])
def test_stopping_the_sweep_ends_every_rank_and_the_fork_server(app, how, while_):
    job = app / "sweep" / "0"
    if while_ == "training":
        # 4 steps of 2 s: still training when the signal comes, as soon as both ranks began a step
        sweep = start_sweep(app, "module.lr=0.1,0.2", env={"APP_SLOW_STEPS": "2"})
        into = [job / "steps" / "rank0_0", job / "steps" / "rank1_0"]
    else:  # rank 0 waits in a collective for rank 1, which never comes: no signal handler can run
        sweep = start_sweep(app, "module.lr=0.1,0.2", "module.fail_rank=1", "module.fail_how=train_hang")
        into = [job / "steps" / "rank0_2", job / "steps" / "rank1_2"]  # rank 1 hangs in its step 2
    try:
        wait_for(lambda: len(started_pids(job)) == 2, SWEEP_TIMEOUT, "both ranks of job 0 to start")
        wait_for(lambda: all(step.exists() for step in into), SWEEP_TIMEOUT, f"{into} to begin")
        if while_ == "blocked on a hung child":  # the signal comes while rank 0 is blocked, not before
            wait_for(Blocked(started_pids(job)[0]), SWEEP_TIMEOUT, "rank 0 to block on the hung rank")
        stopped = time.monotonic()
        stop(sweep, how)
        sweep.wait(timeout=10 if how != "SIGKILL to the sweep" else FAULT_BOUND)
        took = time.monotonic() - stopped
    finally:
        sweep.end()
    assert sweep.returncode != 0, sweep.text()[-6000:]
    pids = started_pids(job)
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), 10, f"every rank of job 0 {pids} to end")
    server = json.loads((job / "started" / "rank1.json").read_text())["ppid"]  # it forked rank 1
    wait_for(lambda: not alive(server), 10, f"the fork server (pid {server}) to end with the sweep")
    assert not (app / "sweep" / "1").exists(), (
        f"a stopped sweep must not start its next job:\n{sweep.text()[-8000:]}"
    )
    print(
        f"{how}, {while_}: the sweep exited {sweep.returncode} {took:.1f} s after the signal, rank 1 with it"
    )


def test_a_signal_while_child_ranks_are_started_ends_every_one(app):
    # rank 1 is forked, rank 2 waits out the stagger: SIGTERM comes while rank 0 starts its children
    job = app / "sweep" / "0"
    sweep = start_sweep(app, "module.lr=0.1,0.2", "trainer.devices=3", env={"MUSHIN_DDP_LAUNCH_DELAY": "30"})
    try:
        wait_for(lambda: (job / "rank_1.log").exists(), SWEEP_TIMEOUT, "rank 1 of job 0 to be forked")
        forked = descendants(sweep.pid)  # the fork server and rank 1
        stopped = time.monotonic()
        sweep.proc.send_signal(signal.SIGTERM)
        sweep.wait(timeout=10)
        took = time.monotonic() - stopped
    finally:
        sweep.end()
    assert sweep.returncode != 0, sweep.text()[-6000:]
    wait_for(lambda: not any(alive(pid) for pid in forked), 10, f"the fork server and rank 1 {forked} to end")
    assert len(forked) >= 2 and not (job / "rank_2.log").exists(), "no rank is started after the signal"
    assert not (app / "sweep" / "1").exists(), sweep.text()[-6000:]
    print(f"SIGTERM while starting child ranks: the sweep exited {sweep.returncode} {took:.1f} s after it")


# What a user gets on Ctrl-C or SIGTERM (issue 64): every rank's graceful shutdown, Lightning's on_exception
# hooks (here a callback's, which takes 1.5 s as a logger's finalize does), within the grace, then the sweep
# ends as the signal does. The grace here (15 s) is far above what they take, far below a hang's bound.
ON_EXCEPTION = {"APP_ON_EXCEPTION_SECONDS": "1.5", "APP_SLOW_STEPS": "0.5", "MUSHIN_DDP_SHUTDOWN_GRACE": "15"}


@pytest.mark.parametrize("how", ["SIGINT to its process group", "SIGTERM to the sweep alone"])
def test_a_signal_gives_every_rank_its_graceful_shutdown_then_ends_the_sweep(app, how):
    job = app / "sweep" / "0"
    sweep = start_sweep(app, "module.lr=0.1,0.2", "trainer.max_epochs=100", env=ON_EXCEPTION)
    try:
        began = [job / "steps" / f"rank{rank}_1" for rank in (0, 1)]
        wait_for(lambda: all(step.exists() for step in began), SWEEP_TIMEOUT, "both ranks of job 0 to train")
        stopped = time.monotonic()
        stop(sweep, how)
        sweep.wait(timeout=float(ON_EXCEPTION["MUSHIN_DDP_SHUTDOWN_GRACE"]) + 10)
        took = time.monotonic() - stopped
    finally:
        sweep.end()
    output, ran = assert_every_rank_shut_down_gracefully(job, how, sweep)
    assert "Child rank 1 failed" not in output, output[-6000:]
    assert not (app / "sweep" / "1").exists(), output[-6000:]
    print(f"{how}: on_exception ran: {ran}; the sweep exited {sweep.returncode} {took:.1f} s after it")


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


# --------------------------------------------------------------------------- the failing sweep's tests


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("how", ["train_raise", "train_kill"])
def test_child_rank_failure_fails_its_job_not_the_sweep(failing_sweep, strategy, how):
    app, proc = failing_sweep
    log = app / "sweep" / f"{how}_{strategy}" / "rank_1.log"
    code = "exit code 1" if how == "train_raise" else "exit code -9 (killed by SIGKILL)"
    expected = ["Child rank 1 failed", code, str(log)]
    if how == "train_raise":
        expected.append("ValueError: injected failure on rank 1")  # the child's own traceback, quoted
    assert_failed_then_healthy(failing_sweep, f"{how}_{strategy}", 1, expected)
    print(
        f"the failing sweep: {len(FAILING)} failed jobs, each followed by a healthy one: {proc.seconds:.1f} s"
    )


def test_child_rank_failure_while_starting_fails_fast(failing_sweep):
    assert_failed_then_healthy(
        failing_sweep, "init_raise", 1, ["Child rank 1 failed", "exit code 1", "injected failure on rank 1"]
    )


def failed(failing_sweep, case):
    """Whether job ``case`` itself failed (the app's RecordError writes a failed job's error.txt): the
    sweep's exit code, which 14 failed jobs make non-zero, tells nothing of one."""
    return (failing_sweep[0] / "sweep" / case / "error.txt").exists()


def test_child_failing_after_rank0_finished_still_fails_its_job(failing_sweep):
    app, _ = failing_sweep
    assert failed(failing_sweep, "end_raise") and not failed(failing_sweep, "end_raise_next")
    error = error_of(failing_sweep, "end_raise")
    assert "Child rank 1 failed" in error and "injected failure on rank 1" in error
    assert records(app / "sweep" / "end_raise")[0], "rank 0 finished the job"
    assert_ranks_agree(app / "sweep" / "end_raise_next")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rank0_failure_ends_its_children(failing_sweep, strategy):
    app, _ = failing_sweep
    case = f"rank0_{strategy}"
    assert failed(failing_sweep, case) and not failed(failing_sweep, f"{case}_next")
    error = error_of(failing_sweep, case)
    # the job's error is rank 0's own, first and last: the child it ended (SIGKILL) did not fail
    assert "ValueError: injected failure on rank 0" in error
    assert "ChildRankError" not in error and "Child rank 1 failed" not in error, error
    assert not records(app / "sweep" / case)
    assert_ranks_agree(app / "sweep" / f"{case}_next")
    # rank 1 was running (it started, and rank 0 failed in training, not at its start) and was ended
    # with its job: gone at the job's end, before the next job started, the sweep still running
    assert 1 in started_pids(app / "sweep" / case)
    assert_ended_with_their_job(app / "sweep" / case, app / "sweep" / f"{case}_next")


def test_child_hanging_before_rendezvous_is_bounded_by_rank_timeout(failing_sweep):
    assert_failed_then_healthy(
        failing_sweep, "init_hang", 1, ["[1] did not reach the process group within 8 s", "rank_timeout"]
    )


def test_child_dying_in_the_rendezvous_fails_its_job_at_once_and_leaves_the_next_one_whole(failing_sweep):
    app, _ = failing_sweep
    assert_failed_then_healthy(
        failing_sweep, "rendezvous_kill", 1, ["Child rank 1 failed", "exit code -9 (killed by SIGKILL)"]
    )
    # rank 0 did not wait out init_process_group's 30 minutes (nor the sweep's bound): its next job
    # started within seconds of this one
    started = [
        app / "sweep" / job / "started" / "rank0.json" for job in ("rendezvous_kill", "rendezvous_kill_next")
    ]
    took = started[1].stat().st_mtime - started[0].stat().st_mtime
    assert took < FAULT_BOUND / 2, f"the next job started {took:.0f} s after the failed one"


def test_child_hanging_in_training_is_bounded_by_the_process_group_timeout(failing_sweep):
    app, _ = failing_sweep
    log = app / "sweep" / "train_hang" / "rank_1.log"
    assert_failed_then_healthy(
        failing_sweep,
        "train_hang",
        1,
        ["Timed out", "child ranks were still running", "rank 1 (pid", f"its log is {log}"],
    )
    # the log shows where the hung rank stood: its stack, dumped before it was ended
    assert "in _maybe_fail" in log.read_text()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_about_to_run_different_things_fail_their_job_fast(failing_sweep, strategy):
    app, _ = failing_sweep
    case = f"mismatch_{strategy}"
    error = error_of(failing_sweep, case)
    assert failed(failing_sweep, case) and not failed(failing_sweep, f"{case}_next")
    assert (
        "RankLaunchError: The ranks of this job are about to run different things in trainer.fit()" in error
    )
    assert "callbacks: rank 0 [EarlyStopping], rank 1 []" in error
    assert "module parameters: rank 0 '4 float64 tensors of " in error, error
    assert ", rank 1 '4 float32 tensors of " in error
    assert not records(app / "sweep" / case)
    assert_ranks_agree(app / "sweep" / f"{case}_next")  # the sweep went on
    # from the mismatched job's module being built (before fit) to the next job's: its whole failure
    jobs = (case, f"{case}_next")
    started = [(app / "sweep" / job / "started" / "rank0.json").stat().st_mtime for job in jobs]
    assert started[1] - started[0] < 30, f"the mismatched job took {started[1] - started[0]:.1f} s to fail"
    print(f"{strategy}: the mismatched job failed within {started[1] - started[0]:.1f} s")
