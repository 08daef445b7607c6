"""What the end-to-end tests share: running apps as real processes, and reading what each rank recorded.

Every process a test starts runs in a session of its own; when it times out, or the test fails,
every process of that session and every descendant (torchrun's workers start sessions of their
own) is ended, and the failure shows the output the processes wrote.
"""

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import pytorch_lightning
import torch

from hydra_fsdp import _check_versions

APPS = Path(__file__).parent / "apps"
LIGHTNING = version("pytorch-lightning")


def builds_here(strategy):
    """Whether hydra_fsdp builds ``strategy`` on these releases, this machine (it refuses, naming what it
    needs, e.g. HydraFSDP without a GPU on Lightning < 2.3, HydraModelParallel without one on torch
    < 2.10). Not what the tests skip by: see should_build."""
    try:
        _check_versions(pytorch_lightning, strategy)
    except ImportError:
        return False
    return True


def _release(version):
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", version).group().split("."))


# What should build here, from the releases alone, decided apart from the code under test: a wrong
# refusal by hydra_fsdp then fails its tests (and tests/test_skips.py) instead of skipping them.
SHOULD_BUILD = {
    "HydraDDP": True,
    "HydraFSDP": torch.cuda.is_available() or _release(LIGHTNING) >= (2, 3, 0),
    "HydraModelParallel": _release(LIGHTNING) >= (2, 4)
    and _release(torch.__version__) >= ((2, 4) if torch.cuda.is_available() else (2, 10)),
}
FSDP_ON_CPU = SHOULD_BUILD["HydraFSDP"]
FSDP_ON_CPU_REASON = (
    f"Lightning {LIGHTNING} refuses FSDP without a GPU (HydraFSDP refuses to be built: tested)"
)
MODEL_PARALLEL = SHOULD_BUILD["HydraModelParallel"]
MODEL_PARALLEL_REASON = (
    f"Lightning {LIGHTNING}, torch {torch.__version__}: no FSDP2 here (HydraModelParallel refuses to be"
    " built: tested)"
)
SWEEP_TIMEOUT = 240  # seconds; a 2-job sweep takes about 10 s on 2 cores
# Seconds within which a failed job must have ended and left nothing running: far below what a hang would
# take (rank_timeout, 600 s by default; a group's timeout, 30 min), far above a loaded machine's slowest
# (62 s seen for one such sweep while CI ran beside other work; 60 s was the bound then).
FAULT_BOUND = 120

# Sweeps of each strategy x lr, one sweep for the tests of both strategies: the strategies that this
# Lightning runs on the CPU (HydraFSDP's tests skip elsewhere, see conftest.py), in Hydra's job order.
SWEPT = ["ddp", "fsdp"] if FSDP_ON_CPU else ["ddp"]
SWEPT_LRS = (0.1, 0.2)
SWEPT_JOBS = len(SWEPT) * len(SWEPT_LRS)
SWEPT_TARGETS = ",".join(f"hydra_fsdp.Hydra{strategy.upper()}" for strategy in SWEPT)  # plain names
SWEPT_LR_VALUES = ",".join(map(str, SWEPT_LRS))


def swept_jobs(strategy):
    """The jobs of ``strategy`` ("ddp" or "fsdp") in a sweep of SWEPT x SWEPT_LRS: [(job number, lr)]."""
    return list(enumerate(SWEPT_LRS, start=SWEPT.index(strategy) * len(SWEPT_LRS)))


class Run:
    """A command started in its own session, its output going to a file (no pipe to fill up)."""

    def __init__(self, command, cwd, env):
        self.command = command
        self.output = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the Run
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=self.output, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.pid = self.proc.pid

    def wait(self, timeout):
        """Wait for it to exit; on timeout end all of it and fail, showing what it wrote."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.end()
            raise AssertionError(
                f"{' '.join(map(str, self.command))} did not finish within {timeout} s and was ended;"
                f" its output:\n{self.text()[-8000:]}"
            ) from None
        self.seconds = time.monotonic() - self.started
        self.returncode = self.proc.returncode
        return self

    def end(self):
        """If it is still running, end it and every process of it. (What it leaves behind once it
        exited is the leak check's to find: its orphans become pytest's children, see conftest.)"""
        if self.proc.poll() is None:
            end_tree(self.pid)
            self.proc.wait()
        self.returncode = self.proc.returncode

    def text(self):
        self.output.seek(0)
        return self.output.read().decode(errors="replace")

    # what tests read of a finished run, as of subprocess.run's result
    stdout = stderr = property(text)


def run(command, cwd, env, timeout=SWEEP_TIMEOUT):
    return Run(command, cwd, env).wait(timeout)


def wait_all(runs, timeout=SWEEP_TIMEOUT):
    """Wait for runs started side by side, each within ``timeout`` of its own start; whatever happens,
    end every one of them."""
    try:
        for started in runs:
            started.wait(max(1.0, started.started + timeout - time.monotonic()))
    finally:
        for started in runs:
            started.end()


def run_side_by_side(starts, at_once, timeout=SWEEP_TIMEOUT):
    """Run independent commands ``at_once`` at a time, the next as soon as one ends: ``starts`` are
    functions that start a Run. Returns their Runs in order, each finished within ``timeout`` of its
    own start; whatever happens, every one started is ended."""
    waiting, running, runs = list(starts), [], []
    try:
        while waiting or running:
            if waiting and len(running) < at_once:
                running.append(waiting.pop(0)())
                runs.append(running[-1])
                continue
            # a finished one is waited for (its time taken), an overdue one fails (and is ended)
            for started in list(running):
                if started.proc.poll() is not None or time.monotonic() > started.started + timeout:
                    started.wait(max(0.0, started.started + timeout - time.monotonic()))
                    running.remove(started)
            time.sleep(0.1)
    finally:
        for started in runs:
            started.end()
    return runs


def descendants(pid):
    """Every live process below ``pid``, and every process of its session, from /proc."""
    parent_of, session_of = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parent_of[int(entry.name)], session_of[int(entry.name)] = int(fields[1]), int(fields[3])
    found = {p for p, session in session_of.items() if session == pid and p != pid}
    frontier = [pid]
    while frontier:
        children = [p for p, parent in parent_of.items() if parent in frontier and p not in found]
        found.update(children)
        frontier = children
    return found


def end_tree(pid):
    """SIGKILL ``pid``, its session and every descendant of it (found before any is reaped)."""
    for victim in descendants(pid) | {pid}:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port():
    """A port free on 127.0.0.1 now (the OS may offer it again later: bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_env(strategy="ddp", env=None):
    """An app's environment. Its jobs claim devices in a folder of its own (HYDRA_FSDP_CLAIMS), as if
    it ran alone on the node: tests that run at once never wait for each other's jobs; a test of
    contention passes one folder to the sweeps it runs at once."""
    full_env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", APP_STRATEGY=strategy, HYDRA_FULL_ERROR="1")
    full_env["HYDRA_FSDP_CLAIMS"] = tempfile.mkdtemp(prefix="hydra-fsdp-claims-")
    atexit.register(shutil.rmtree, full_env["HYDRA_FSDP_CLAIMS"], ignore_errors=True)  # not left in /tmp
    full_env.pop("PYTHONPATH", None)  # the app must find its own modules, as a user's would
    full_env.update(env or {})
    return full_env


def run_app(app_dir, *overrides, strategy="ddp", env=None, timeout=SWEEP_TIMEOUT, multirun=True):
    command = [sys.executable, "app.py"] + (["-m"] if multirun else []) + list(overrides)
    return run(command, app_dir, app_env(strategy, env), timeout)


def sweep_in(app_dir, *overrides, **kwargs):
    """Run a multirun into <app>/sweep, one job dir per job number."""
    return run_app(app_dir, "hydra.sweep.dir=sweep", *overrides, **kwargs)


def start_sweep(app_dir, *overrides, script="app.py", strategy="ddp", env=None, sigint_ignored=False):
    """Start a sweep of ``script`` and return its Run: a session of its own, what a terminal's Ctrl-C
    reaches.

    ``sigint_ignored``: started as a background job of a shell without job control is, SIGINT
    ignored (which exec keeps)."""
    python = [sys.executable] + (["-c", IGNORING_SIGINT, sys.executable] if sigint_ignored else [])
    command = [*python, script, "-m", "hydra.sweep.dir=sweep", *overrides]
    return Run(command, app_dir, app_env(strategy, env))


IGNORING_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN);"
    " os.execv(sys.argv[1], sys.argv[1:])"
)


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
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two looks
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
    assert proc.returncode == 0, f"sweep failed ({proc.returncode}):\n{proc.text()[-9000:]}"
    return proc


def copy_app(directory):
    """Put the sweep app and its sibling module in ``directory``, as a user's project would be."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("sweep_app.py", "shapes.py", "shards.py"):
        shutil.copy(APPS / name, directory / ("app.py" if name == "sweep_app.py" else name))
    return directory


def copy_template(directory):
    """Put the lightning-hydra-template-shaped project in ``directory``, with the module it shares with
    the sweep app (src/shards.py)."""
    shutil.copytree(APPS / "template", directory)
    shutil.copy(APPS / "shards.py", directory / "src" / "shards.py")
    return directory


def assert_failed_job_then_healthy_job(
    app, proc, failed_rank, *, expect_in_error, failed="0", healthy="1", error=None, first_of_sweep=True
):
    """Job ``failed`` failed with an error (``error``, else the sweep's output) that names the rank;
    the next, ``healthy``, trained on every rank; nothing left. ``first_of_sweep``: ``failed`` was the
    sweep's first job (no fork server yet at its start)."""
    assert proc.returncode != 0, "Hydra exits non-zero when a job of the sweep failed"
    error = proc.text() if error is None else error
    for text in expect_in_error:
        assert text in error, f"{text!r} not in job {failed}'s error:\n{error[-6000:]}"
    sweep = app / "sweep"
    assert not records(sweep / failed), "the failed job must not have finished on any rank"
    assert_ranks_agree(sweep / healthy)
    assert_ended_with_their_job(sweep / failed, sweep / healthy)
    # the failed job left nothing behind for the next one (which may have started its own ranks
    # already, at Hydra's start of the job: a port and a signal thread of its own)
    first = json.loads((sweep / failed / "started" / "rank0.json").read_text())
    start = json.loads((sweep / healthy / "started" / "rank0.json").read_text())
    assert {key: start["env"][key] for key in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")} == dict.fromkeys(
        ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")
    )
    # a port of its own: torch's store of the failed job's port would hide the new one's. The ports
    # each job's ranks were given (rank 0's is unset where its module was built before its launch)
    failed_ports, healthy_ports = (
        {
            json.loads(p.read_text())["env"]["MASTER_PORT"]
            for p in (sweep / job / "started").glob("rank*.json")
        }
        - {None}
        for job in (failed, healthy)
    )
    assert len(healthy_ports) == 1, f"job {healthy}'s ranks were given the ports {healthy_ports}"
    assert not healthy_ports & failed_ports, (
        f"job {healthy} rendezvoused on job {failed}'s port {failed_ports}"
    )
    assert start["process_group"] is False
    own = "hydra-fsdp-signals"
    server = "hydra-fsdp-fork-server"  # reads the sweep's fork server (one at a time), started by a stage
    assert first["threads"].count(server) <= (0 if first_of_sweep else 1)
    assert start["threads"].count(server) <= 1
    assert [t for t in start["threads"] if t not in (own, server)] == [
        t for t in first["threads"] if t not in (own, server)
    ]
    assert start["threads"].count(own) <= 1, "no thread of job 0 may outlive it"


def alive_at(job_dir, moment):
    """The processes below the sweep's process at ``moment`` ("start" or "end") of the job, as the app's
    RecordAlive callback saw them while the sweep ran: {pid: command line}."""
    path = Path(job_dir, f"alive_at_{moment}.json")
    assert path.exists(), f"{path} is missing: run the sweep with {RECORD_ALIVE}"
    return {int(pid): command for pid, command in json.loads(path.read_text()).items()}


RECORD_ALIVE = "+hydra.callbacks.record_alive._target_=__main__.RecordAlive"


def assert_ended_with_their_job(*job_dirs):
    """Every child rank of each job (``job_dirs`` in the sweep's order) was gone when hydra_fsdp had
    ended the job, at Hydra's end of it, the sweep still running, and so before the next job started:
    not only once the sweep exited, when the fork server kills whatever it still runs."""
    for n, job_dir in enumerate(map(Path, job_dirs)):
        children = {rank: pid for rank, pid in started_pids(job_dir).items() if rank != 0}
        left = {rank: pid for rank, pid in children.items() if pid in alive_at(job_dir, "end")}
        assert not left, f"job {job_dir.name}'s child ranks {left} were still running at the job's end"
        if n + 1 < len(job_dirs):
            running = alive_at(job_dirs[n + 1], "start")
            left = {rank: pid for rank, pid in children.items() if pid in running}
            assert not left, (
                f"job {job_dir.name}'s child ranks {left} were still running as the next job started"
            )


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def stop(sweep, how):
    """Stop a running sweep (a Run) ``how`` a user would: Ctrl-C, SIGTERM (a scheduler), SIGKILL."""
    if how == "SIGINT to its process group":  # what Ctrl-C in a terminal does
        os.killpg(sweep.pid, signal.SIGINT)
    else:
        sweep.proc.send_signal(signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGKILL)


class Blocked:
    """Whether a process's main thread is blocked: asleep in the kernel, and no CPU time spent since the
    last look (a look every 0.2 s, see wait_for; 5 looks running: a second)."""

    def __init__(self, pid):
        self.stat, self.last, self.still = f"/proc/{pid}/task/{pid}/stat", None, 0

    def __call__(self):
        fields = Path(self.stat).read_text().rsplit(")", 1)[1].split()
        state, ticks = fields[0], int(fields[11]) + int(fields[12])  # utime + stime
        self.still = self.still + 1 if state == "S" and ticks == self.last else 0
        self.last = ticks
        return self.still >= 5


def sweeper_or_skip(module: str, install: str) -> None:
    """Skip the calling test module where one of the `sweepers` extra's packages is not installed (the
    README's test command), unless HYDRA_FSDP_REQUIRE_SWEEPERS=1 (CI, which installs them): then fail."""
    if os.environ.get("HYDRA_FSDP_REQUIRE_SWEEPERS") == "1":
        __import__(module)
    else:
        pytest.importorskip(module, reason=f"{install} (or: pip install -e '.[test,sweepers]')")


def assert_every_rank_shut_down_gracefully(job_dir, how, sweep):
    """After ``how`` (a signal, as ``stop`` sends it) stopped ``sweep`` mid-fit: both ranks of the job in
    ``job_dir`` finished their on_exception, the job was reported as interrupted, no rank was killed, and
    the sweep exited as the signal says. Returns the sweep's output and what each on_exception saw."""
    output = sweep.text()
    ran = {rank: (job_dir / f"on_exception_rank{rank}").read_text() for rank in (0, 1)
           if (job_dir / f"on_exception_rank{rank}").exists()}  # fmt: skip
    assert sorted(ran) == [0, 1], f"on_exception completed on ranks {ran} only:\n{output[-6000:]}"
    name = "SIGINT (Ctrl-C)" if how.startswith("SIGINT") else "SIGTERM"
    assert f"The job was interrupted by {name} after" in output, output[-6000:]
    assert "still running after the grace" not in output and "killed by SIGKILL" not in output, output[-6000:]
    expected = (130, -signal.SIGINT) if how.startswith("SIGINT") else (143,)
    assert sweep.returncode in expected, f"exit status {sweep.returncode}:\n{output[-6000:]}"
    return output, ran
