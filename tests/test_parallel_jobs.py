"""Jobs at once on one node: Hydra's joblib and submitit_local launchers, and the devices each job holds.

Those launchers run each job in a worker process whose ``__main__`` is the launcher's, and the task
function arrives there pickled by value: every child rank must still run it (not the config
fallback). Jobs that run at once must never share a device: on the CPU a job's ranks run on cores
of their own, on CUDA on GPUs of their own, claimed through files a held ``flock`` keeps
(hydra_fsdp._claim), which the kernel lets go of when the holder dies.
"""

import contextlib
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    APPS,
    FSDP_ON_CPU,
    SWEPT,
    SWEPT_LR_VALUES,
    SWEPT_TARGETS,
    copy_app,
    copy_template,
    ok,
    records,
    run_side_by_side,
    start_sweep,
    swept_jobs,
    wait_all,
)
from shared import nothing_outlives
from test_readme import blocks

pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install hydra-joblib-launcher")
pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")

CORES = sorted(os.sched_getaffinity(0))
JOBLIB = ("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
SUBMITIT_LOCAL = ("hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5")
LAUNCHERS = {"joblib": JOBLIB, "submitit_local": SUBMITIT_LOCAL}
FALLBACK_WARNING = "child ranks build the config's trainer and module"


def yaml_project(tmp):
    return Path(shutil.copytree(APPS / "yaml_app", tmp / "yaml_app"))


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Every sweep of this module, two at a time: {name: (app dir, run)}. Those of the contention
    tests share a claims folder of their own: they are started together, as one user's sweeps."""
    shared_claims = str(tmp_path_factory.mktemp("claims"))
    starts, names = [], []

    def add(name, directory, *overrides, script="app.py", env=None):
        starts.append(functools.partial(start_sweep, directory, *overrides, script=script, env=env))
        names.append((name, directory))

    for launcher, overrides in LAUNCHERS.items():
        tmp = tmp_path_factory.mktemp(f"template-{launcher}")
        add(("template", launcher), copy_template(tmp / "template"), *overrides, f"trainer={','.join(SWEPT)}",
            "model.lr=0.1", script="src/train.py")  # fmt: skip
        if launcher != "joblib":  # under joblib, the plain app's sweep is the cores test's, below
            tmp = tmp_path_factory.mktemp(f"yaml-{launcher}")
            add(("yaml", launcher), yaml_project(tmp), *overrides,
                f"trainer.strategy._target_={SWEPT_TARGETS}", "model.lr=0.1", script="train.py")  # fmt: skip
    if FSDP_ON_CPU:  # the README's hydra-zen train.py (zen(train).hydra_main, HydraFSDP)
        readme = tmp_path_factory.mktemp("readme")
        (readme / "train.py").write_text(next(block for block in blocks("python") if "zen(train)" in block))
        add("zen", readme, *JOBLIB, "trainer.max_epochs=1,2", script="train.py")
    # 4 jobs x 2 ranks, 2 jobs at once: each job's share of the cores (the YAML app: its classes are
    # in a module of its own, which a worker's Hydra can locate, unlike the sweep app's __main__.Tiny);
    # also the plain app under joblib (fit then test), in the jobs of lr 0.1
    add("cores", yaml_project(tmp_path_factory.mktemp("cores")), *JOBLIB,
        f"trainer.strategy._target_={SWEPT_TARGETS}", f"model.lr={SWEPT_LR_VALUES}", script="train.py",
        env={"APP_MEET_IN": str(tmp_path_factory.mktemp("meeting"))})  # fmt: skip
    # the basic launcher, jobs of 2, 1 and 2 ranks: each its own thread count; the process's after
    add("threads", copy_app(tmp_path_factory.mktemp("threads") / "app"), "trainer.devices=2,1,2",
        "+hydra.callbacks.record_process._target_=__main__.RecordProcess")  # fmt: skip
    with nothing_outlives("this module's sweeps"):
        runs = run_side_by_side(starts, at_once=2)
        # two sweeps at once in one claims folder, each job claiming every core: one job at a time
        two = [copy_app(tmp_path_factory.mktemp(f"one-at-a-time-{n}") / "app") for n in (0, 1)]
        env = {"HYDRA_FSDP_CLAIMS": shared_claims}
        started = [start_sweep(app, "module.lr=0.1,0.2", env=env) for app in two]
        wait_all(started)
    found = {name: (directory, run) for (name, directory), run in zip(names, runs)}
    found["yaml", "joblib"] = found["cores"]
    found["one at a time"] = list(zip(two, started))
    return found


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_template_under_worker_launchers_runs_the_task_function_on_every_rank(sweeps, launcher):
    """lightning-hydra-template's train.py: callbacks and loggers from config groups, fit then
    test(best), on every rank; the fallback would build neither (and fail the rank check)."""
    template, proc = sweeps["template", launcher]
    ok(proc)
    assert FALLBACK_WARNING not in proc.text()
    for strategy in SWEPT:
        job_dir = template / "sweep" / str(SWEPT.index(strategy))
        fit, tested = records(job_dir, "fit"), records(job_dir, "test")
        assert sorted(fit) == sorted(tested) == [0, 1], (job_dir, proc.text()[-3000:])
        for seen in (*fit.values(), *tested.values()):
            assert seen["callbacks"] == ["EarlyStopping", "ModelCheckpoint", "ModelSummary"]
            assert seen["loggers"] == ["CSVLogger"] and seen["lr"] == 0.1 and seen["world"] == 2
            assert seen["strategy"] == f"hydra_fsdp.lightning.Hydra{strategy.upper()}"
            assert seen["output_dir"] == str(job_dir)
        assert tested[0]["ckpt_path"] == tested[1]["ckpt_path"] != ""
        assert fit[0]["pid"] != fit[1]["pid"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_plain_hydra_main_without_a_module_key_under_worker_launchers(sweeps, launcher):
    """A plain @hydra.main app whose config has no ``module`` key: no fallback could run it."""
    project, proc = sweeps["yaml", launcher]
    ok(proc)
    for strategy in SWEPT:
        # under joblib, the cores test's sweep, which sweeps the lrs too: its job of lr 0.1
        job = swept_jobs(strategy)[0][0] if launcher == "joblib" else SWEPT.index(strategy)
        job_dir = project / "sweep" / str(job)
        for stage in ("fit", "test"):
            seen = records(job_dir, stage)
            assert sorted(seen) == [0, 1], (job_dir, stage, proc.text()[-3000:])
            for rank in seen.values():
                assert rank["world"] == 2 and rank["output_dir"] == str(job_dir) and rank["lr"] == 0.1
                assert rank["strategy"] == f"hydra_fsdp.lightning.Hydra{strategy.upper()}"
            assert seen[0]["pid"] != seen[1]["pid"]


@pytest.mark.fsdp_cpu
def test_hydra_zen_under_joblib_runs_the_task_function_on_every_rank(sweeps):
    """The README's train.py (zen(train).hydra_main, HydraFSDP, fit then test(best)) in joblib's
    workers: the fallback would fail there (its config names the datamodule ``data``)."""
    project, proc = sweeps["zen"]
    ok(proc)
    assert FALLBACK_WARNING not in proc.text()
    assert proc.text().count("Restoring states from the checkpoint path at") == 2, proc.text()[-3000:]
    for job in ("0", "1"):
        log = (project / "sweep" / job / "rank_1.log").read_text()
        assert "GLOBAL_RANK: 1" in log and "Traceback" not in log, log[-3000:]


def job_window(job_dir):
    """When a job trained: from its first rank's start of fit to its last rank's end of it."""
    fit = records(job_dir).values()
    return min(seen["fit_started"] for seen in fit), max(seen["time"] for seen in fit)


def overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


def test_jobs_at_once_run_on_cores_of_their_own(sweeps):
    """joblib, 2 jobs at once, 4 jobs x 2 ranks: a job claims half of the cores, its ranks split
    them; ranks of jobs that overlapped in time never share a core, none runs more threads than its
    job's cores allow. (The first job to train waits there for a second: loky may well run the
    jobs one after another otherwise, one worker still importing while the other runs three.)"""
    app, proc = sweeps["cores"]
    ok(proc)
    share = max(1, len(CORES) // 2)
    jobs = [job for strategy in SWEPT for job, _ in swept_jobs(strategy)]
    held, windows = {}, {}
    for job in jobs:
        seen = records(app / "sweep" / str(job))
        assert sorted(seen) == [0, 1], proc.text()[-3000:]
        held[job] = {core for rank in seen.values() for core in rank["affinity"]}
        windows[job] = job_window(app / "sweep" / str(job))
        assert len(held[job]) == share, (job, seen)
        for rank in seen.values():
            assert rank["threads"] == max(1, share // 2) == int(rank["omp_num_threads"]), rank
        if share >= 2:  # each rank its own cores
            assert not set(seen[0]["affinity"]) & set(seen[1]["affinity"])
    overlapped = [(a, b) for a in jobs for b in jobs if a < b and overlap(windows[a], windows[b])]
    assert overlapped, f"no two jobs ran at once under n_jobs=2: {windows}"
    for a, b in overlapped:
        assert not held[a] & held[b], f"jobs {a} and {b} ran at once on cores {held[a] & held[b]}"


def test_each_job_computes_its_own_thread_count(sweeps):
    """trainer.devices=2,1,2 under the basic launcher: a job alone has every core, its ranks split
    them; a later job's count is not the last job's; the sweep's process gets its own back."""
    app, proc = sweeps["threads"]
    ok(proc)
    for job, world in enumerate((2, 1, 2)):
        seen = records(app / "sweep" / str(job))
        assert sorted(seen) == list(range(world))
        for rank in seen.values():
            assert rank["threads"] == max(1, len(CORES) // world), (job, rank)
            assert sorted({core for r in seen.values() for core in r["affinity"]}) == CORES
    after = json.loads((app / "sweep" / "process_after.json").read_text())
    assert after == {"threads": torch.get_num_threads(), "omp_num_threads": None, "affinity": CORES}


def test_two_sweeps_whose_jobs_need_every_core_run_their_jobs_one_at_a_time(sweeps):
    """Two sweeps at once on one node, one user: each job claims every core (the basic launcher runs
    one job at a time), so a job waits, saying so, until the other sweep's job ends."""
    (app_a, run_a), (app_b, run_b) = sweeps["one at a time"]
    windows = []
    for app, proc in ((app_a, run_a), (app_b, run_b)):
        ok(proc)
        for job in (0, 1):
            assert sorted(records(app / "sweep" / str(job))) == [0, 1]
            windows.append((app.parent.name, job, job_window(app / "sweep" / str(job))))
    for name_a, job_a, a in windows:
        for name_b, job_b, b in windows:
            if (name_a, job_a) < (name_b, job_b):
                assert not overlap(a, b), f"{name_a} job {job_a} and {name_b} job {job_b} ran at once"
    waited = run_a.text() + run_b.text()
    assert "this job waits for" in waited and "It starts as soon as enough are free" in waited


# -------------------- claims, between real processes

CLAIMER = """
import contextlib, json, sys
from pathlib import Path
import hydra_fsdp
folder, count, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for round in range(rounds):
    if round:
        sys.stdin.readline()  # a new job of this process: claims when told to
    with contextlib.ExitStack() as job:  # its end lets go of the claim
        print(json.dumps(hydra_fsdp._claim(folder, "gpu", ["0", "1", "2", "3"], count, job)), flush=True)
        sys.stdin.readline()  # holds its claim until told to let go
"""


class Claimer:
    """A process claiming ``count`` of 4 GPUs (names only: no GPU is touched) ``rounds`` times, each
    held until ``let_go``."""

    def __init__(self, folder, count, rounds=1):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLAIMER, str(folder), str(count), str(rounds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def claimed(self, timeout=60):
        """The devices of its next claim, or None if it has not claimed within ``timeout`` s."""
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            return None
        line = self.proc.stdout.readline()
        assert line, f"the claimer exited ({self.proc.wait()}): {self.proc.stderr.read()}"
        return json.loads(line)

    def let_go(self):
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    claim_again = let_go

    def end(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def claimers(tmp_path):
    started = []

    def start(count, rounds=1):
        started.append(Claimer(tmp_path, count, rounds))
        return started[-1]

    yield start
    for claimer in started:
        claimer.end()


def test_claims_are_disjoint_and_a_waiter_starts_when_a_holder_lets_go(claimers):
    a, b = claimers(2), claimers(2)
    held = [a.claimed(), b.claimed()]
    assert sorted(held[0] + held[1]) == [0, 1, 2, 3]
    waiter = claimers(1)
    assert waiter.claimed(timeout=3) is None, "all 4 are held: it must wait"
    a.let_go()
    assert waiter.claimed() in ([held[0][0]], [held[0][1]])


def test_a_killed_holders_devices_go_to_the_waiting_job(claimers):
    """The kernel lets go of a dead process's locks, SIGKILL or not: the waiter gets what it held. (How fast
    is printed, not asserted: a blocked thread's wake-up is the scheduler's, over 1 s on a loaded machine.)"""
    holder = claimers(3)
    held = holder.claimed()
    waiter = claimers(2)
    assert waiter.claimed(timeout=3) is None
    holder.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    got = waiter.claimed(timeout=30)
    assert got is not None and len(got) == 2 and set(got) & set(held), (held, got)
    print(f"the waiter claimed {got} {time.monotonic() - killed:.2f} s after the holder was killed")


def test_a_reused_process_gets_a_new_slice(claimers):
    reused = claimers(2, rounds=2)
    first = reused.claimed()
    other = claimers(2)
    second_holder = other.claimed()
    reused.let_go()  # its first job ended; a third claims what it held
    third = claimers(2)
    assert third.claimed() == first
    other.let_go()
    reused.claim_again()
    assert reused.claimed() == second_holder, "its second job holds what is free now"


def test_asking_for_more_than_the_node_has_fails_at_once(tmp_path):
    import hydra_fsdp

    started = time.monotonic()
    with pytest.raises(hydra_fsdp.RankLaunchError, match="asks for 5 gpus.* may use 4 on this node"):
        hydra_fsdp._claim(tmp_path, "gpu", ["0", "1", "2", "3"], 5, contextlib.ExitStack())
    assert time.monotonic() - started < 1.0


def test_claims_live_where_only_the_user_can_write(tmp_path, monkeypatch):
    import hydra_fsdp

    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    monkeypatch.setenv("HYDRA_FSDP_CLAIMS", str(open_folder))
    with pytest.raises(hydra_fsdp.RankLaunchError, match="which is owner uid .* mode 777; expected a folder"):
        hydra_fsdp._claims_folder()
    monkeypatch.setenv("HYDRA_FSDP_CLAIMS", "off")
    assert hydra_fsdp._claims_folder() is None
    monkeypatch.delenv("HYDRA_FSDP_CLAIMS")
    default = hydra_fsdp._claims_folder()
    assert default == Path(f"/tmp/hydra_fsdp-{os.getuid()}") and default.stat().st_mode & 0o777 == 0o700


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_jobs_at_once_with_one_gpu_each_run_one_after_the_other(tmp_path):
    """On a one-GPU machine, joblib n_jobs=2 and devices=1: the second job waits for the GPU the first
    holds, says so, then trains on it."""
    project = yaml_project(tmp_path)
    overrides = (*JOBLIB, "model.lr=0.1,0.2", "test=false", "trainer.accelerator=gpu", "trainer.devices=1")
    proc = start_sweep(project, *overrides, script="train.py", env={"HYDRA_FSDP_GPUS": "0"})
    wait_all([proc])
    ok(proc)
    windows = [job_window(project / "sweep" / str(job)) for job in (0, 1)]
    assert not overlap(*windows), windows
    assert "this job waits for 1 free gpus of 0" in proc.text()
