"""A job's end: destroying the process group with gloo collectives still in flight takes seconds.

torch < 2.4 frees a process group holding the GIL, and gloo's destructor waits for its worker
threads, which need the GIL to free a finished collective whose tensor Python already let go of:
without care both wait forever (a fit-then-test job's end hung so on torch 2.3, 6 runs in 20).
Here rank 1 joins 20 collectives a second late while rank 0, which let go of their tensors,
destroys the group at once: before the fix this hung on every run on torch 2.3.
"""

import os
import sys
import threading
import time
from pathlib import Path

from helpers import Run, free_port, run, wait_for

import hydra_fsdp

ROOT = Path(__file__).resolve().parent.parent

RANK = """
import os, sys, time
import torch, torch.distributed as dist
import hydra_fsdp
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
if rank == 1:
    time.sleep(1)
for _ in range(20):
    tensor = torch.ones(1024)
    dist.all_reduce(tensor, async_op=True)
    del tensor  # the queued collective alone holds it now
if rank == 1:
    time.sleep(1)
    os._exit(0)  # as a child rank leaves
started = time.monotonic()
hydra_fsdp._destroy_process_group()
print(f"destroyed in {time.monotonic() - started:.2f} s", flush=True)
"""


def test_destroying_the_group_with_collectives_in_flight_does_not_hang(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    child = Run([sys.executable, str(script), "1"], tmp_path, env)
    try:
        rank0 = run([sys.executable, str(script), "0"], tmp_path, env, timeout=60)
    finally:
        child.wait(timeout=60)
    assert rank0.returncode == 0 and child.returncode == 0, rank0.text()
    assert "destroyed in" in rank0.text(), rank0.text()


def test_an_abort_that_blocks_does_not_hold_up_the_end_of_the_stage(monkeypatch):
    """NCCL's abort can block (a communicator stuck in a kernel). The fork server's reader starts a failed
    child's abort on a thread of its own; the stage's end, on the main thread at the job's end, must not
    wait for it past its bound (hydra_fsdp._KILL_WAIT), or the job, and the sweep, would never end."""
    monkeypatch.setattr(hydra_fsdp, "_abort_groups", lambda: time.sleep(60))
    monkeypatch.setattr(hydra_fsdp, "_KILL_WAIT", 1.0)  # its bound (5 s), shorter for the test
    abort = hydra_fsdp._StageAbort(free_port())
    with abort.stage():
        threading.Thread(target=abort.abort, args=(1,), daemon=True).start()  # as on_failure is started
        wait_for(lambda: abort.aborted, 10, "the abort to begin")
        started = time.monotonic()
    took = time.monotonic() - started
    assert took < hydra_fsdp._KILL_WAIT + 2, f"the stage ended {took:.1f} s after the blocked abort began"
    assert not abort.in_stage and abort.for_rank == 1  # a later abort, waiting for the lock, aborts none
