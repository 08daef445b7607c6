"""Soak: does a sweep that trained to the end always exit 0? Counts non-zero exits and aborts.

    python bench/soak.py                 # 30 runs of each configuration (about 25 minutes on 2 cores)
    python bench/soak.py --runs 5 --configs torchrun-2x1-fsdp

    python bench/soak.py --runs 30 --timeout 60 --configs fit-test-ddp fit-test-best-ddp   # a job's end

Each run is a 2-job sweep of tests/apps/sweep_app.py (2 ranks a job, CPU, gloo), in a fresh
directory; the fit-test configurations run ``trainer.fit`` then ``trainer.test`` in each job
(``ckpt_path=None``, or ``"best"`` with a checkpoint callback), whose end hung on torch 2.3 before
the process group was destroyed holding its backends. A run counts as a hang when it was still
running at ``--timeout`` and was ended, as an abort when any process of it printed ``terminate
called`` or ``Fatal Python error`` (gloo's threads outliving the interpreter: SIGABRT at exit),
and as a failure when any command of it exited non-zero. Runs of the configurations are
interleaved. Every process runs in a session of its own and is ended with it on timeout.
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


def self_launched(*overrides):
    return lambda: [[sys.executable, *SWEEP, *overrides]]


FIT_TEST = "stages=[fit,test:same:none]"
FIT_TEST_BEST = (
    "trainer.enable_checkpointing=true",
    "trainer.callbacks=[${keep_last}]",
    "stages=[fit,test:same:best]",
)
CONFIGS = {
    "torchrun-2x1-ddp": ("ddp", torchrun(2, 1)),
    "torchrun-2x1-fsdp": ("fsdp", torchrun(2, 1)),
    "torchrun-1x2-fsdp": ("fsdp", torchrun(1, 2)),
    "self-launched-ddp": ("ddp", self_launched()),
    "self-launched-fsdp": ("fsdp", self_launched()),
    # not run by default: a job's end after fit then test
    "fit-test-ddp": ("ddp", self_launched(FIT_TEST)),
    "fit-test-best-ddp": ("ddp", self_launched(*FIT_TEST_BEST)),
    "fit-test-fsdp": ("fsdp", self_launched(FIT_TEST)),
    "fit-test-best-fsdp": ("fsdp", self_launched(*FIT_TEST_BEST)),
}
DEFAULT_CONFIGS = [name for name in CONFIGS if not name.startswith("fit-test")]


def run_once(strategy, commands, timeout):
    """Run one sweep (its commands side by side); return (exit codes, output, seconds, hung)."""
    directory = Path(tempfile.mkdtemp(prefix="soak-"))
    shutil.copy(APPS / "sweep_app.py", directory / "app.py")
    shutil.copy(APPS / "shapes.py", directory / "shapes.py")
    env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", APP_STRATEGY=strategy)
    env.pop("PYTHONPATH", None)
    outputs = [tempfile.TemporaryFile() for _ in commands]  # noqa: SIM115 - read after the runs
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            command, cwd=directory, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        for command, out in zip(commands, outputs)
    ]
    hung = False
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, started + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        hung = True
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
    return [proc.returncode for proc in procs], text, seconds, hung


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--timeout", type=float, default=240)
    args = parser.parse_args()
    results = {name: [] for name in args.configs}
    for run in range(args.runs):
        for name in args.configs:
            strategy, commands = CONFIGS[name]
            codes, text, seconds, hung = run_once(strategy, commands(), args.timeout)
            aborted = any(marker in text for marker in ABORTS)
            results[name].append((codes, aborted, seconds, hung))
            print(f"run {run + 1}/{args.runs} {name}: exit codes {codes}, {'HUNG, ' if hung else ''}"
                  f"{'ABORT, ' if aborted else ''}{seconds:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
            if aborted or hung or any(codes):
                print("\n".join(text.splitlines()[-40:]), file=sys.stderr)
    print(
        "| configuration | runs (jobs) | hangs | non-zero exits | aborts (SIGABRT at exit) | median s a run"
        " | max s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        hangs = sum(1 for *_, hung in rows if hung)
        failed = sum(1 for codes, *_ in rows if any(codes))
        aborts = sum(1 for _, aborted, *_ in rows if aborted)
        seconds = [row[2] for row in rows]
        print(
            f"| {name} | {len(rows)} ({2 * len(rows)}) | {hangs} | {failed} | {aborts}"
            f" | {statistics.median(seconds):.1f} | {max(seconds):.1f} |"
        )


if __name__ == "__main__":
    main()
