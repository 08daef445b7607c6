"""What the end-to-end tests share: running the sweep app, and reading what each rank recorded."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

APPS = Path(__file__).parent / "apps"
SWEEP_TIMEOUT = 240  # seconds; a 2-job sweep takes about 10 s on 2 cores


def run_app(app_dir, *overrides, strategy="ddp", env=None, timeout=SWEEP_TIMEOUT, multirun=True):
    full_env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", APP_STRATEGY=strategy, HYDRA_FULL_ERROR="1")
    full_env.pop("PYTHONPATH", None)  # the app must find its own modules, as a user's would
    full_env.update(env or {})
    command = [sys.executable, "app.py"] + (["-m"] if multirun else []) + list(overrides)
    started = time.monotonic()
    proc = subprocess.run(command, cwd=app_dir, env=full_env, capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.monotonic() - started
    return proc


def sweep_in(app_dir, *overrides, **kwargs):
    """Run a multirun into <app>/sweep, one job dir per job number."""
    return run_app(app_dir, "hydra.sweep.dir=sweep", *overrides, **kwargs)


def records(job_dir, stage="fit"):
    """What each rank of one job recorded for one stage, by rank."""
    return {
        seen["rank"]: seen
        for seen in (
            json.loads(p.read_text()) for p in sorted(Path(job_dir, "seen").glob(f"{stage}_rank*.json"))
        )
    }


def started_pids(job_dir):
    return {
        int(p.stem[4:]): json.loads(p.read_text())["pid"] for p in Path(job_dir, "started").glob("rank*.json")
    }


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes: it holds no port and no memory
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def assert_ranks_agree(job_dir, stage="fit", world=2):
    seen = records(job_dir, stage)
    assert sorted(seen) == list(range(world)), f"ranks that recorded {stage}: {sorted(seen)}"
    ranks = list(seen.values())
    for key in ("lr", "job", "tag", "stamp", "cwd", "output_dir", "original_cwd", "world", "strategy"):
        assert len({json.dumps(r[key]) for r in ranks}) == 1, (
            f"ranks disagree on {key}: {[r[key] for r in ranks]}"
        )
    assert ranks[0]["world"] == world
    assert Path(ranks[0]["output_dir"]).resolve() == Path(job_dir).resolve()
    assert len({r["pid"] for r in ranks}) == world
    return seen


def ok(proc):
    assert proc.returncode == 0, (
        f"sweep failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


def copy_app(directory):
    """Put the sweep app and its sibling module in ``directory``, as a user's project would be."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("sweep_app.py", "shapes.py"):
        shutil.copy(APPS / name, directory / ("app.py" if name == "sweep_app.py" else name))
    return directory


FAULT_BOUND = 60  # seconds within which a failed job must have ended and left nothing running


def assert_failed_job_then_healthy_job(app, proc, failed_rank, *, expect_in_error):
    """Job 0 failed with an error that names the rank; job 1 trained on every rank; nothing left."""
    assert proc.returncode != 0, "Hydra exits non-zero when a job of the sweep failed"
    for text in expect_in_error:
        assert text in proc.stderr, f"{text!r} not in the sweep's error output:\n{proc.stderr[-4000:]}"
    assert not records(app / "sweep" / "0"), "the failed job must not have finished on any rank"
    assert_ranks_agree(app / "sweep" / "1")
    for job in ("0", "1"):
        for rank, pid in started_pids(app / "sweep" / job).items():
            assert not alive(pid), f"job {job} rank {rank} (pid {pid}) is still running"
    # the failed job left nothing behind for the next one
    start = json.loads((app / "sweep" / "1" / "started" / "rank0.json").read_text())
    assert start["env"] == {"LOCAL_RANK": None, "MASTER_PORT": None, "WORLD_SIZE": None, "NODE_RANK": None}
    assert start["process_group"] is False
    first = json.loads((app / "sweep" / "0" / "started" / "rank0.json").read_text())
    assert start["threads"] == first["threads"], "no thread of job 0 may outlive it"


def start_sweep(app_dir, *overrides, env=None):
    full_env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", APP_STRATEGY="ddp")
    full_env.pop("PYTHONPATH", None)
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "app.py", "-m", "hydra.sweep.dir=sweep", *overrides],
        cwd=app_dir,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: what a terminal's Ctrl-C reaches
    )


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
