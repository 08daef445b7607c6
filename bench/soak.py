"""Soak: does a sweep that trained to the end always exit 0? Counts non-zero exits and aborts.

    python bench/soak.py                 # 30 runs of each configuration (about 25 minutes on 2 cores)
    python bench/soak.py --runs 5 --configs torchrun-2x1-fsdp

Each run is a 2-job sweep of tests/apps/sweep_app.py (2 ranks a job, CPU, gloo), in a fresh
directory. A run counts as an abort when any process of it printed ``terminate called`` or
``Fatal Python error`` (gloo's threads outliving the interpreter: SIGABRT at exit), and as a
failure when any command of it exited non-zero. Runs of the configurations are interleaved.
Every process runs in a session of its own and is ended with it on timeout.
"""

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

APPS = Path(__file__).resolve().parent.parent / "tests" / "apps"
SWEEP = ["app.py", "-m", "hydra.sweep.dir=sweep", "module.lr=0.1,0.2", "module.stamp=same-on-every-rank"]
ABORTS = ("terminate called", "Fatal Python error")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nnodes, nproc):
    def commands():
        port = free_port()
        return [
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", *SWEEP,
             f"trainer.num_nodes={nnodes}", f"trainer.devices={nproc}"]
            for node in range(nnodes)
        ]  # fmt: skip

    return commands


def self_launched():
    return [[sys.executable, *SWEEP]]


CONFIGS = {
    "torchrun-2x1-ddp": ("ddp", torchrun(2, 1)),
    "torchrun-2x1-fsdp": ("fsdp", torchrun(2, 1)),
    "torchrun-1x2-fsdp": ("fsdp", torchrun(1, 2)),
    "self-launched-ddp": ("ddp", self_launched),
    "self-launched-fsdp": ("fsdp", self_launched),
}


def run_once(strategy, commands, timeout):
    """Run one sweep (its commands side by side); return (exit codes, output, seconds)."""
    directory = Path(tempfile.mkdtemp(prefix="soak-"))
    shutil.copy(APPS / "sweep_app.py", directory / "app.py")
    shutil.copy(APPS / "shapes.py", directory / "shapes.py")
    env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", APP_STRATEGY=strategy)
    env.pop("PYTHONPATH", None)
    outputs = [tempfile.TemporaryFile() for _ in commands]
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            command, cwd=directory, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        for command, out in zip(commands, outputs)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, started + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - started
    text = ""
    for out in outputs:
        out.seek(0)
        text += out.read().decode(errors="replace")
    shutil.rmtree(directory, ignore_errors=True)
    return [proc.returncode for proc in procs], text, seconds


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    results = {name: [] for name in args.configs}
    for run in range(args.runs):
        for name in args.configs:
            strategy, commands = CONFIGS[name]
            codes, text, seconds = run_once(strategy, commands(), args.timeout)
            aborted = any(marker in text for marker in ABORTS)
            results[name].append((codes, aborted, seconds))
            print(f"run {run + 1}/{args.runs} {name}: exit codes {codes}, {'ABORT, ' if aborted else ''}{seconds:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            if aborted or any(codes):
                print("\n".join(text.splitlines()[-40:]), file=sys.stderr)
    print("| configuration | runs | non-zero exits | aborts (SIGABRT at exit) | median s a run |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        failed = sum(1 for codes, _, _ in rows if any(codes))
        aborts = sum(1 for _, aborted, _ in rows if aborted)
        print(
            f"| {name} | {len(rows)} | {failed} | {aborts} | {statistics.median(s for *_, s in rows):.1f} |"
        )


if __name__ == "__main__":
    main()
