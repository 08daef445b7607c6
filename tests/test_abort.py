"""A child rank that dies mid-stage on a backend that, like NCCL, does not notice a dead peer.

On NCCL rank 0 would wait in its collective for the dead rank until the group's timeout (30 min),
then torch would tear the sweep down; hydra_fsdp aborts the group the moment the fork server hears
the child's exit (``_Job.abort_stage_of``). Gloo, which every other CPU test runs on, fails the
collective by itself, so this path runs only here: on ``tests/apps/stub_backend.py``, gloo wrapped
to block on a dead peer until ``abort()`` (and then return silently, as NCCL's abort releases a
thread blocked in a CUDA sync), imported on every rank of the sweep by a ``sitecustomize``.
The last test: the abort releases a collective on any group, not only the default one.
"""

import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    APPS,
    RECORD_ALIVE,
    Run,
    assert_ended_with_their_job,
    assert_failed_job_then_healthy_job,
    records,
    sweep_in,
)

from hydra_fsdp import _release

pytestmark = pytest.mark.skipif(
    _release(torch.__version__) < (2, 7),
    reason=f"torch {torch.__version__}: before 2.7 ProcessGroup has no abort() for a Python subclass to"
    " override (the stub backend's release), and hydra_fsdp aborts the backends instead",
)

BACKEND = "hangs_on_dead_peer"
KILLED_MID_FIT = ("module.fail_rank=1", "module.fail_how=train_kill")  # at training step 2, job 0
CHECKPOINTS = ("trainer.enable_checkpointing=true", "trainer.callbacks=[${keep_last}]")
# ... and Lightning's checkpoint on an exception, which it saves after the stage failed (on_exception)
ON_EXCEPTION = (
    "{_target_:pytorch_lightning.callbacks.OnExceptionCheckpoint,dirpath:'${hydra:runtime.output_dir}'}"
)
CHECKPOINTS_ON_EXCEPTION = (CHECKPOINTS[0], f"trainer.callbacks=[${{keep_last}},{ON_EXCEPTION}]")
# Far above what an abort takes, far below what a hang would: the rank_timeout (60 s) and the
# group's timeout (30 min) are what rank 0 would otherwise wait for.
ABORT_BOUND = 10  # seconds from the dead peer to the job's end
SWEEP_BOUND = 60  # seconds for the whole 2-job sweep (each job starts a fresh pair of ranks)


@pytest.fixture
def on_stub_backend(app, tmp_path):
    """Every process of the sweep (rank 0, fork server, so every child) imports the stub backend."""
    hook = tmp_path / "hook"
    hook.mkdir()
    shutil.copy(APPS / "stub_backend.py", hook / "stub_backend.py")
    (hook / "sitecustomize.py").write_text("import stub_backend\n")
    log = tmp_path / "stub_backend.log"
    return {"PYTHONPATH": str(hook), "STUB_BACKEND_LOG": str(log)}, log


def sweep_killing_rank_1(app, env, *overrides, jobs="module.lr=0.1,0.2"):
    return sweep_in(
        app,
        jobs,
        f"+trainer.strategy.process_group_backend={BACKEND}",
        *KILLED_MID_FIT,
        RECORD_ALIVE,
        *overrides,
        env=env,
        timeout=SWEEP_BOUND,
    )


def events(log):
    """What the backend noted, by kind: (time, pid, rank, text)."""
    found = []
    for line in log.read_text().splitlines():
        stamp, pid, rank, text = re.match(r"([\d.]+) pid (\d+) rank (\d+): (.*)", line).groups()
        found.append((float(stamp), int(pid), int(rank), text))
    return found


def assert_aborted_in_seconds(app, log):
    """hydra_fsdp's fork-server thread aborted job 0's group, and the job ended within seconds of rank 1's
    death. Usually rank 0 is already blocked on the dead peer then, and the abort releases it; when the
    fork server reports the exit first, the abort finds rank 0 between collectives, and its next one
    fails (or, silent, completes). With a job 1: it ran in the same sweep process, on a group of its own.
    Returns which of the two it was, the seconds from the first sign of the death to the abort, to the
    release (or None) and to the job's end (job 1's start; else its group's abort on the main thread)."""
    noted = events(log)
    rank0 = json.loads((app / "sweep" / "0" / "started" / "rank0.json").read_text())["pid"]
    mine = [(t, text) for t, pid, rank, text in noted if pid == rank0 and rank == 0]
    gone = [t for t, text in mine if "the peer is gone" in text]
    aborts = [(t, text) for t, text in mine if text.startswith("abort() called")]
    released = [t for t, text in mine if "released by abort()" in text]
    assert aborts, f"hydra_fsdp never aborted the group; the backend noted:\n{log.read_text()}"
    # on a thread of its own, which the fork server's reader starts: an abort that blocks holds up no reply
    assert "hydra-fsdp-abort" in aborts[0][1], "the first abort comes from hydra_fsdp's abort thread"
    aborted = aborts[0][0]
    if gone and gone[0] <= aborted:
        assert released and released[0] >= aborted, f"not released by the abort:\n{log.read_text()}"
        how, start = "blocked on the dead peer, released by the abort", gone[0]
        released = released[0] - start
    else:
        how, start, released = "aborted before rank 0's next collective", aborted, None
    if (app / "sweep" / "1").exists():
        # job 1 ran in the sweep process that ran job 0 (the sweep lived), on a group built afresh
        assert records(app / "sweep" / "1")[0]["pid"] == rank0, "job 1's rank 0 is the sweep process of job 0"
        built = [t for t, pid, rank, text in noted if pid == rank0 and text.startswith("building")]
        assert len(built) == 2, f"rank 0 built one group per job: {built}"
        ended = (app / "sweep" / "1" / "started" / "rank0.json").stat().st_mtime
    else:  # the job's close: _destroy_process_group(aborted=True) aborting every group, on the main thread
        ended = max(t for t, text in aborts if "(from thread MainThread)" in text)
    assert 0 < ended - start < ABORT_BOUND, f"job 0 took {ended - start:.1f} s from rank 1's death to its end"
    return how, aborted - start, released, ended - start


def checkpoints(job_dir):
    return sorted(p.relative_to(job_dir) for p in Path(job_dir).rglob("*.ckpt"))


def test_child_killed_mid_fit_aborts_the_group_and_fails_its_job_in_seconds(app, on_stub_backend):
    env, log = on_stub_backend
    proc = sweep_killing_rank_1(app, env, *CHECKPOINTS_ON_EXCEPTION)
    rank_1_log = app / "sweep" / "0" / "rank_1.log"
    assert_failed_job_then_healthy_job(
        app,
        proc,
        1,
        expect_in_error=[
            "ChildRankError: Child rank 1 failed",
            "exit code -9 (killed by SIGKILL)",
            f"its log is {rank_1_log}",
        ],
    )
    how, aborted, released, ended = assert_aborted_in_seconds(app, log)
    # after the abort rank 0's next collective failed, as NCCL's does on an aborted communicator
    assert "communicator was aborted" in proc.text()
    assert not checkpoints(app / "sweep" / "0"), "no checkpoint of a job whose group was aborted"
    # Lightning tried one on the exception: hydra_fsdp's save_checkpoint refused it
    assert "in on_exception" in proc.text() and "job.raise_if_aborted()" in proc.text()
    assert Path("checkpoints/last.ckpt") in checkpoints(app / "sweep" / "1"), "job 1 checkpoints as asked"
    print(
        f"on {BACKEND}: rank 0 {how}: aborted {aborted:.3f} s after rank 1's death showed,"
        f" released {released if released is None else round(released, 3)} s, job 1 started {ended:.2f} s"
        f" after; sweep of 2 jobs {proc.seconds:.1f} s"
    )


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no checkpoints"])
def test_an_abort_that_releases_rank0_silently_still_fails_the_job(app, on_stub_backend, checkpointing):
    # The abort returns rank 0 from its collective as if it had completed, and every later collective
    # completes at once: Lightning would go on to the end of fit (and checkpoint at the epoch's end).
    env, log = on_stub_backend
    env["STUB_BACKEND_AFTER_ABORT"] = "complete"
    # one job: the test above runs the next job of the sweep after an abort
    proc = sweep_killing_rank_1(app, env, *(CHECKPOINTS if checkpointing else ()), jobs="module.lr=0.1")
    text = proc.text()
    assert proc.returncode != 0, f"job 0 must fail:\n{text[-6000:]}"
    assert "ChildRankError: Child rank 1 failed" in text and "killed by SIGKILL" in text, text[-6000:]
    assert "communicator was aborted" not in text
    how, aborted, _released, ended = assert_aborted_in_seconds(app, log)
    job0 = app / "sweep" / "0"
    assert not checkpoints(job0), f"a checkpoint was written after the abort: {checkpoints(job0)}"
    if checkpointing:  # the epoch's checkpoint is where rank 0 stopped: hydra_fsdp's save_checkpoint
        assert not records(job0), "rank 0 stopped at the checkpoint, before fit's end"
        assert "in save_checkpoint\n" in text and "job.raise_if_aborted()" in text, text[-6000:]
    else:  # rank 0 went on to the end of fit: only the stage's end tells the job failed
        assert sorted(records(job0)) == [0], "rank 0 finished fit on the silently aborted group"
        assert "in stage\n" in text and "self.raise_if_aborted()" in text, text[-6000:]
    assert_ended_with_their_job(job0)  # gone at the job's end, not only once the sweep exited
    print(
        f"silent release ({'checkpointing' if checkpointing else 'no checkpoints'}): rank 0 {how}:"
        f" aborted {aborted:.3f} s after rank 1's death showed, the job ended {ended:.2f} s after;"
        f" sweep {proc.seconds:.1f} s"
    )


# Rank 0 blocked in a collective on a group other than the default one -- FSDP's HYBRID_SHARD groups,
# a DeviceMesh's, a user's new_group -- when its peer dies, and hydra_fsdp aborting as the fork server's
# reader thread does (``_abort_groups()``): is rank 0 released? (The subgroup's timeout is 5 s here, 30 min
# by default.)
ONE_RANK = """
import os, sys, threading, time
from datetime import timedelta
import stub_backend, hydra_fsdp, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group(stub_backend.NAME, rank=rank, world_size=2, timeout=timedelta(seconds=5))
group = dist.new_group([0, 1], timeout=timedelta(seconds=5)) if sys.argv[2] == "subgroup" else None
dist.all_reduce(torch.ones(1), group=group)
if rank == 1:
    os.kill(os.getpid(), 9)
def abort_as_hydra_fsdp_does():  # once the collective below blocks on the dead peer
    print(f"blocked: {stub_backend.blocked_on_dead_peer.wait(30)}", flush=True)
    hydra_fsdp._abort_groups()
threading.Thread(target=abort_as_hydra_fsdp_does, name="hydra-fsdp-abort").start()
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=group)
    print(f"released after {time.monotonic() - started:.1f} s")
except RuntimeError as error:
    print(f"failed after {time.monotonic() - started:.1f} s: {error}")
"""


@pytest.mark.parametrize(
    "group",
    [
        "default",
        "subgroup",
    ],
)
def test_the_abort_releases_a_collective_on_any_group(tmp_path, group):
    shutil.copy(APPS / "stub_backend.py", tmp_path / "stub_backend.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(tmp_path))
    ranks = [Run([sys.executable, "-c", ONE_RANK, str(rank), group], tmp_path, env) for rank in (0, 1)]
    try:
        rank0 = ranks[0].wait(timeout=60)
    finally:
        for rank in ranks:
            rank.end()
    assert "blocked: True" in rank0.text(), f"it never blocked on the dead peer:\n{rank0.text()[-3000:]}"
    assert "released after" in rank0.text(), rank0.text()[-3000:]
