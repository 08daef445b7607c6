"""What a long sweep leaves on one GPU, and NCCL's abort in the sweep process: for a lent machine.

    python bench/gpu_long_sweep.py        # about 2 minutes on one GPU; exits non-zero on a failure

NCCL refuses two ranks on one GPU, so the sweep's two-rank jobs share cuda:0 over gloo: HydraDDP
and HydraFSDP jobs of one sweep of tests/apps/memory_app.py (failing on rank 1 and on rank 0), printing
``torch.cuda.memory_allocated()`` at each job's start (before and after a gc) and
``memory_reserved()`` (what the last job's end gave back). Then, in this process, a world-size-1
NCCL group that a thread aborts through hydra_fsdp's ``_abort_groups`` (the API this torch
has), the group ended as a job's end ends it, and a fresh NCCL group's all-reduce.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hydra_fsdp

ROOT = Path(__file__).resolve().parent.parent
LEFT_AT_MOST = 2 * (1600 * 1600 + 1600) * 4 // 5  # 20% of memory_app's model
ON_CUDA_0 = [
    "trainer.accelerator=gpu",
    "trainer.devices=1",
    "+trainer.strategy.parallel_devices=["
    + ",".join(["{_target_:torch.device,type:cuda,index:0}"] * 2)
    + "]",
    "+trainer.strategy.process_group_backend=gloo",
]


def sweep(strategy: str, plan: list) -> bool:
    app = Path(tempfile.mkdtemp(prefix=f"gpu-{strategy}-"))
    shutil.copy(ROOT / "tests" / "apps" / "memory_app.py", app / "app.py")
    shutil.copy(ROOT / "tests" / "apps" / "shapes.py", app / "shapes.py")
    env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", APP_STRATEGY=strategy, HYDRA_FULL_ERROR="1")
    jobs = ",".join(map(str, range(len(plan))))
    command = [
        sys.executable,
        "app.py",
        "-m",
        "hydra.sweep.dir=sweep",
        f"plan=[{','.join(plan)}]",
        f"+n={jobs}",
    ]
    started = time.monotonic()
    proc = subprocess.run(
        command + ON_CUDA_0, cwd=app, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    print(f"\n{strategy}: plan {plan}, {time.monotonic() - started:.0f} s, exit {proc.returncode}")
    good = True
    for job, planned in enumerate(plan):
        path = app / "sweep" / str(job) / "memory_rank0.json"
        if not path.exists():
            print(f"  job {job}: no memory_rank0.json\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            return False
        m = json.loads(path.read_text())
        done = (app / "sweep" / str(job) / "done.json").exists()
        left = max(m["cuda_allocated_before_gc"], m["cuda_allocated"])
        print(
            f"  job {job} ({planned}): at its start cuda allocated {m['cuda_allocated_before_gc']} before gc,"
            f" {m['cuda_allocated']} after, reserved {m['cuda_reserved']}; cpu tensors {m['after_gc']};"
            f" finished: {done}"
        )
        good &= (
            left <= LEFT_AT_MOST and done == ("fail" not in planned) and not any(m["group_alive_before_gc"])
        )
    return good


def abort_then_fresh_group() -> bool:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", **hydra_fsdp._NCCL_KEEPS_THE_PROCESS)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    tensor = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    aborter = threading.Thread(target=hydra_fsdp._abort_groups)
    started = time.monotonic()
    aborter.start()
    aborter.join(timeout=60)
    print(
        f"\nabort from a thread (torch {torch.__version__}): returned {not aborter.is_alive()}"
        f" in {time.monotonic() - started:.2f} s"
    )
    hydra_fsdp._destroy_process_group(aborted=True)
    print(f"after the job's end: a process group is initialized: {dist.is_initialized()}")
    os.environ["MASTER_PORT"] = "29534"
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    tensor = torch.full((4,), 3.0, device="cuda")
    dist.all_reduce(tensor)
    print(f"a fresh NCCL group's all-reduce: {tensor.tolist()}")
    dist.destroy_process_group()
    return tensor.tolist() == [3.0] * 4


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    results = [
        sweep("ddp", ["ddp", "full:fail1", "ddp:fail0", "sharded", "ddp"]),
        abort_then_fresh_group(),
    ]
    print("\nall good" if all(results) else f"\nFAILED: {results}")
    sys.exit(0 if all(results) else 1)
