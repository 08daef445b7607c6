"""Warm child ranks (``warm_ranks=True``): one child process takes every job of the sweep.

Every guarantee of the cold path must hold: each job on its own config and port, ``__main__``
targets, a failed job never poisons the next (its children are replaced), nothing left running
when the sweep ends or dies.
"""

import json
import signal
import time

import pytest
from helpers import (
    FAULT_BOUND,
    SWEEP_TIMEOUT,
    alive,
    assert_failed_job_then_healthy_job,
    assert_ranks_agree,
    ok,
    records,
    start_sweep,
    started_pids,
    sweep_in,
    wait_for,
)

WARM = "+trainer.strategy.warm_ranks=true"


def child_pids(app, jobs):
    return [records(app / "sweep" / str(job))[1]["pid"] for job in jobs]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_warm_child_takes_every_job(app, strategy):
    proc = ok(sweep_in(app, WARM, "module.lr=0.1,0.2,0.3", strategy=strategy))
    ports = set()
    for job, lr in enumerate((0.1, 0.2, 0.3)):
        seen = assert_ranks_agree(app / "sweep" / str(job))
        assert seen[1]["lr"] == lr and seen[1]["job"] == job and seen[1]["tag"].endswith(f"module.lr={lr}")
        assert "GLOBAL_RANK: 1" in (app / "sweep" / str(job) / "rank_1.log").read_text()  # its own log
        ports.add(seen[1]["master_port"])
    assert len(set(child_pids(app, range(3)))) == 1, "the same child process took all three jobs"
    assert len(ports) == 3, "each job rendezvoused on its own port"
    pid = child_pids(app, [0])[0]
    wait_for(lambda: not alive(pid), 10, "the warm child to exit with the sweep")
    print(f"3 jobs x 2 ranks, warm {strategy}: {proc.seconds:.1f} s")


def test_each_job_gets_rank0_environment_of_that_job(app):
    # hydra.job.env_set is applied by Hydra around each job on rank 0: a warm child must follow
    ok(sweep_in(app, WARM, "module.lr=0.1,0.2", "+hydra.job.env_set.JOB_TAG=job_${hydra:job.num}"))
    for job in ("0", "1"):
        start = json.loads((app / "sweep" / job / "started" / "rank1.json").read_text())
        assert start["env"]["WORLD_SIZE"] == "2" and start["env"]["LOCAL_RANK"] == "1"
        assert start["job_tag"] == f"job_{job}"
    assert len(set(child_pids(app, [0, 1]))) == 1


def test_warm_stages_of_one_job(app):
    ok(sweep_in(app, WARM, "stages=[fit,test]", "module.lr=0.1,0.2"))
    for job in ("0", "1"):
        assert_ranks_agree(app / "sweep" / job, "test")
    assert len(set(child_pids(app, [0, 1]))) == 1


@pytest.mark.parametrize("how", ["train_raise", "train_kill"])
def test_failed_warm_child_is_replaced_for_the_next_job(app, how):
    proc = sweep_in(app, WARM, "module.lr=0.1,0.2,0.3", "module.fail_rank=1", f"module.fail_how={how}")
    assert_failed_job_then_healthy_job(app, proc, 1, expect_in_error=["Child rank 1 failed"])
    failed = started_pids(app / "sweep" / "0")[1]
    assert failed not in child_pids(app, [1, 2]) and len(set(child_pids(app, [1, 2]))) == 1


def test_warm_child_that_died_between_jobs_is_replaced(app):
    ok(sweep_in(app, WARM, "module.lr=0.1,0.2,0.3", "module.fail_rank=0", "module.fail_how=init_kill_warm_child",
                "module.fail_job=1"))  # fmt: skip
    for job in ("0", "1", "2"):
        assert_ranks_agree(app / "sweep" / job)
    first, second, third = child_pids(app, [0, 1, 2])
    assert first != second == third, "job 1 found its warm child dead, started one, and job 2 reused it"


def test_rank0_failure_replaces_warm_children(app):
    proc = sweep_in(app, WARM, "module.lr=0.1,0.2", "module.fail_rank=0", "module.fail_how=train_raise")
    assert proc.returncode != 0 and "injected failure on rank 0" in proc.stderr
    assert_ranks_agree(app / "sweep" / "1")
    for job in ("0", "1"):
        assert not any(alive(pid) for pid in started_pids(app / "sweep" / job).values())


def test_warm_children_die_with_the_sweep(app):
    sweep = start_sweep(app, WARM, "module.lr=0.1,0.2,0.3", env={"APP_SLOW_STEPS": "0.3"})
    try:
        wait_for(lambda: records(app / "sweep" / "0"), SWEEP_TIMEOUT, "job 0 to finish")
        sweep.send_signal(signal.SIGKILL)  # between or during jobs: nothing gets to clean up
        sweep.wait(timeout=FAULT_BOUND)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    child = json.loads((app / "sweep" / "0" / "seen" / "fit_rank1.json").read_text())["pid"]
    wait_for(lambda: not alive(child), 10, f"the warm child {child} to exit after the sweep died")
    time.sleep(0.5)
