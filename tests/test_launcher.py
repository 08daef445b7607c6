"""``hydra/launcher=hydra_fsdp``: every rank of every job, rank 0 included, is a fresh process forked from
the fork server, with torchrun's environment; the sweep's process runs Hydra's job machinery and never
trains. Real sweeps of tests/apps/launcher_app.py (a plain @hydra.main app), 2 CPU ranks a job, gloo; the
app's Record callback writes what Hydra's callbacks see in the sweep's process, job by job."""

import functools
import json
import os
import pickle
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
    FAULT_BOUND,
    FSDP_ON_CPU,
    SWEEP_TIMEOUT,
    Run,
    alive,
    app_env,
    assert_every_rank_shut_down_gracefully,
    copy_template,
    records,
    run_side_by_side,
    start_sweep,
    stop,
    wait_for,
)
from shared import nothing_outlives
from test_readme import EXAMPLE, REPORT

LAUNCHER = ("hydra/launcher=hydra_fsdp", "+hydra.callbacks.record._target_=__main__.Record")
# the faults sweep's jobs, in order
FAULTS = ("segfault", "double", "plain", "collective", "after", "rendezvous")
# the strategies sweep's, a job each (HydraFSDP where this Lightning runs it on the CPU); HydraDDP trains 2
# more in the template's sweep, Lightning's own ddp 3 in the faults sweep
STRATEGIES = {"hydra": "HydraDDP", "fabric": "Fabric", "torch": "init_process_group"}
STRATEGIES.update({"hydra_fsdp": "HydraFSDP"} if FSDP_ON_CPU else {})


def launcher_app(directory):
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(APPS / "launcher_app.py", directory / "app.py")
    return directory


def jobs(app):
    """Each job's end as Hydra's callbacks saw it in the sweep's process, by job number."""
    lines = (app / "sweep" / "jobs.jsonl").read_text().splitlines()
    return {entry["job"]: entry for entry in map(json.loads, lines)}


def seen(app, job):
    """What each rank of a job recorded at its end, by rank."""
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (app / "sweep" / str(job) / "seen").glob("*")}


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Every sweep of this module, two at a time: {name: (app dir, run)}."""
    starts, apps = {}, {}

    def add(name, *overrides):
        apps[name] = launcher_app(tmp_path_factory.mktemp(name))
        starts[name] = functools.partial(start_sweep, apps[name], *LAUNCHER, *overrides)

    add("faults", "hydra.launcher.nproc_per_node=2", f"case={','.join(FAULTS)}")  # Lightning's own ddp
    add(
        "strategies",
        "hydra.launcher.nproc_per_node=${devices}",
        f"strategy={','.join(STRATEGIES)}",
    )
    add("timeout", "hydra.launcher.nproc_per_node=2", "hydra.launcher.job_timeout=10", "case=hang,plain")
    add("mismatch", "hydra.launcher.nproc_per_node=1", "strategy=ddp,hydra")  # the Trainer asks for 2
    # rank 0 hands back nothing (an earlier run's result in its dir), or what cannot be pickled
    add("results", "hydra.launcher.nproc_per_node=1", "case=exit,unpicklable")
    stale = apps["results"] / "sweep" / "0" / "rank_0.result.pickle"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(pickle.dumps({"value": "an earlier run's"}))
    # Lightning's order (rank 1 once rank 0 reached the group), then torchrun's (together), read per job
    add("order", "hydra.launcher.nproc_per_node=2", "hydra.launcher.start_ranks_together=${together}",
        "case=slow_build", "together=false,true")  # fmt: skip
    # a task function no child can import by name: ranks are forks of the job's agent
    apps["closure"] = launcher_app(tmp_path_factory.mktemp("closure"))
    starts["closure"] = functools.partial(
        start_sweep, apps["closure"], *LAUNCHER, "hydra.launcher.nproc_per_node=2", "strategy=hydra,torch",
        env={"LAUNCHER_APP_CLOSURE": "1"},
    )  # fmt: skip
    meeting = tmp_path_factory.mktemp("meeting")
    add("n_jobs", *N_JOBS, f"meet_in={meeting}")
    if FSDP_ON_CPU:  # the example's default strategy is HydraFSDP, which Lightning < 2.3 refuses on the CPU
        apps["example"] = tmp_path_factory.mktemp("example")  # module.lr=0.01,0.05, 2 ranks
        starts["example"] = functools.partial(
            start_sweep, apps["example"], "hydra/launcher=hydra_fsdp", script=EXAMPLE
        )
    apps["template"] = copy_template(tmp_path_factory.mktemp("template") / "template")  # HydraDDP
    starts["template"] = functools.partial(
        start_sweep, apps["template"], "hydra/launcher=hydra_fsdp", "model.lr=0.1,0.2", script="src/train.py"
    )
    with nothing_outlives("this module's sweeps"):
        runs = run_side_by_side(list(starts.values()), at_once=2)
    return {name: (apps[name], run) for name, run in zip(starts, runs)}


def test_rank_0_segfault_fails_only_its_job_and_the_sweeper_gets_rank_0s_return_value(sweeps):
    app, run = sweeps["faults"]
    assert run.returncode != 0, "Hydra exits non-zero when a job of the sweep failed"
    ended = jobs(app)
    assert sorted(ended) == list(range(len(FAULTS))), run.text()[-4000:]
    assert ended[0]["status"] == "FAILED"
    for text in ("Rank 0 failed first", "SIGSEGV", str(app / "sweep" / "0" / "rank_0.log")):
        assert text in ended[0]["error"], ended[0]["error"]
    # the next job's rank 0 return value is what Hydra's callbacks (and so the sweeper) received
    assert ended[1]["status"] == "COMPLETED"
    assert ended[1]["value"] == seen(app, 1)[0], (ended[1], seen(app, 1))


def test_a_jobs_default_dtype_is_not_the_next_jobs(sweeps):
    app, _ = sweeps["faults"]
    assert {rank: r["param_dtype"] for rank, r in seen(app, 1).items()} == {
        0: "torch.float64",
        1: "torch.float64",
    }
    assert {rank: r["param_dtype"] for rank, r in seen(app, 2).items()} == {
        0: "torch.float32",
        1: "torch.float32",
    }


def test_rank_1_raising_while_rank_0_waits_in_a_collective_fails_its_job_in_seconds(sweeps):
    app, _ = sweeps["faults"]
    collective = jobs(app)[3]
    assert collective["status"] == "FAILED"
    for text in ("Rank 1 failed first", "injected on rank 1", "rank_1.log"):
        assert text in collective["error"], collective["error"]
    assert collective["seconds"] < FAULT_BOUND / 2, collective  # not the group's 30 minutes
    assert jobs(app)[4]["status"] == "COMPLETED" and sorted(seen(app, 4)) == [0, 1]


def test_a_rank_killed_while_rank_0_waits_in_init_process_group_fails_its_job_in_seconds(sweeps):
    """D4 of the strategies alone (docs/reliability.md): there rank 0 is the sweep's process and waits in
    torch's C++ store until the group's timeout. Here every rank of the job ends as soon as one dies."""
    app, _ = sweeps["faults"]
    rendezvous = jobs(app)[5]
    assert rendezvous["status"] == "FAILED"
    for text in ("Rank 1 failed first", "SIGKILL", "rank_1.log"):
        assert text in rendezvous["error"], rendezvous["error"]
    assert rendezvous["seconds"] < FAULT_BOUND / 2, rendezvous  # not init_process_group's 30 minutes


TRAINED_BY = [("faults", "DDPStrategy"), *(("strategies", name) for name in STRATEGIES.values())]
TRAINED_BY += [("closure", "HydraDDP"), ("closure", "init_process_group")]


@pytest.mark.parametrize(("sweep", "strategy"), TRAINED_BY)
def test_every_rank_is_a_fresh_process_with_torchruns_environment(sweeps, sweep, strategy):
    """Lightning's own ddp, hydra_fsdp's strategies, Fabric's ddp and plain torch.distributed: each trains,
    every rank in a process of its own, as torchrun would start it."""
    app, run = sweeps[sweep]
    trained = [job for job, entry in jobs(app).items() if (entry["value"] or {}).get("strategy") == strategy]
    assert len(trained) >= (2 if sweep == "faults" else 1), (jobs(app), run.text()[-3000:])
    pids = set()
    for job in trained:
        ranks = seen(app, job)
        assert sorted(ranks) == [0, 1], (job, ranks)
        for rank, record in ranks.items():
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
            assert record["env"] == env
            assert (record["global_rank"], record["world"], record["strategy"]) == (rank, 2, strategy)
            assert record["tasks_run_here"] == 1, (
                "a rank runs one job's task function, in a process of its own"
            )
            assert record["lr_type"] == "float"
            pids.add(record["pid"])
        assert jobs(app)[job]["status"] == "COMPLETED"
    assert len(pids) == 2 * len(trained)


def test_each_job_runs_hydras_job_machinery_in_an_agent_of_its_own(sweeps):
    """Hydra's run_job (its callbacks: Record) runs for each job in a process of the job's own, never the
    sweep's, whether the job trained, segfaulted or failed in a collective: what one job's machinery does to
    its process no later job sees, and the sweep's process holds no lock while a job runs."""
    app, run = sweeps["faults"]
    ended = [jobs(app)[job] for job in range(len(FAULTS))]
    agents = {entry["sweep_pid"] for entry in ended}
    assert len(agents) == len(FAULTS) and run.pid not in agents, (run.pid, agents)
    assert all(entry["tasks_run_here"] == 0 for entry in ended)


def test_the_lightning_hydra_template_trains_under_the_launcher(sweeps):
    """Its own train.py and configs (trainer=ddp: HydraDDP, devices=2): callbacks and loggers from config
    groups, fit then test(best), on every rank; rank 0's return value (the metric) ends each job."""
    template, run = sweeps["template"]
    assert run.returncode == 0, run.text()[-6000:]
    for job in (0, 1):
        fit, tested = (
            records(template / "sweep" / str(job), "fit"),
            records(template / "sweep" / str(job), "test"),
        )
        assert sorted(fit) == sorted(tested) == [0, 1], run.text()[-3000:]
        for record in (*fit.values(), *tested.values()):
            assert record["callbacks"] == ["EarlyStopping", "ModelCheckpoint", "ModelSummary"]
            assert record["loggers"] == ["CSVLogger"] and record["world"] == 2
        assert run.pid not in {fit[0]["pid"], fit[1]["pid"]} and fit[0]["pid"] != fit[1]["pid"]
    assert "2 job(s), 0 failed" in run.text() and "returned tensor(" in run.text()


@pytest.mark.parametrize("sweep", ["faults", "strategies", "timeout", "n_jobs", "mismatch", "closure"])
def test_the_sweeps_process_never_trains(sweeps, sweep):
    app, _ = sweeps[sweep]
    ranks = {record["pid"] for job in jobs(app) for record in seen(app, job).values()}
    for entry in jobs(app).values():
        assert entry["tasks_run_here"] == 0, "the task function ran in the sweep's process"
        assert (entry["process_group"], entry["default_dtype"], entry["cuda_initialized"]) == (
            False,
            "torch.float32",
            False,
        ), entry
        assert entry["sweep_pid"] not in ranks


def test_a_trainer_asking_for_other_ranks_than_nproc_per_node_fails_at_once_naming_both(sweeps):
    app, _ = sweeps["mismatch"]
    ended = jobs(app)
    assert [ended[job]["status"] for job in (0, 1)] == ["FAILED", "FAILED"]
    assert "devices=2" in ended[0]["error"] and "world size (1)" in ended[0]["error"]  # Lightning's ddp
    assert "started 1 processes" in ended[1]["error"] and "1 x 2 = 2" in ended[1]["error"]  # HydraDDP
    assert not list(app.glob("sweep/*/seen"))


def test_the_sweep_ends_with_a_summary_the_failed_jobs_first(sweeps):
    _, run = sweeps["faults"]
    summary = run.text().split("hydra_fsdp: 6 job(s), 3 failed:")[1]
    rows = [line.split()[0] for line in summary.splitlines()[1:7]]
    assert rows == ["#0", "#3", "#5", "#1", "#2", "#4"], summary[:2000]
    assert "job #3 starts (case=collective): 2 rank(s)" in run.text()


def test_a_result_rank_0_never_handed_back_is_never_an_earlier_runs_and_one_it_cannot_is_named(sweeps):
    """Job 0's rank 0 exits without a result, into a dir holding an earlier run's; job 1's returns a lock."""
    app, run = sweeps["results"]
    ended = jobs(app)
    assert [ended[job]["status"] for job in (0, 1)] == ["FAILED", "FAILED"], run.text()[-3000:]
    assert "handed back no return value" in ended[0]["error"], ended[0]["error"]
    assert "an earlier run's" not in run.text()
    assert "return value (a lock) cannot be pickled" in ended[1]["error"], ended[1]["error"]
    assert not list(app.glob("sweep/*/*.pickle")), "a result or launch file was left in a job's dir"


def test_rank_0_logs_to_the_jobs_log_beside_the_launchers_lines_and_rank_n_to_its_own(sweeps):
    """As under Hydra's basic launcher: the task's logging lines, at the job's levels, in
    <job dir>/<task name>.log; rank N's in rank_N.log with its output."""
    app, _ = sweeps["strategies"]
    for job in jobs(app):
        job_dir = app / "sweep" / str(job)
        job_log = (job_dir / "app.log").read_text()
        assert f"[launcher_app][INFO] - rank 0 runs job {job}" in job_log, job_log
        assert f"hydra_fsdp: job #{job} starts" in job_log and "rank 1 runs" not in job_log
        assert f"rank 1 runs job {job}" in (job_dir / "rank_1.log").read_text()


def test_ranks_start_in_lightnings_order_or_together_as_asked(sweeps):
    """Rank 1 starts once rank 0, which builds for 3 s first, has reached the process group (a logger's
    database made by rank 0 alone, then opened by the others); with start_ranks_together, 1 s after it
    (MUSHIN_DDP_LAUNCH_DELAY), as torchrun would."""
    app, run = sweeps["order"]
    assert [jobs(app)[job]["status"] for job in (0, 1)] == ["COMPLETED"] * 2, run.text()[-3000:]
    meets = [float((app / "sweep" / str(job) / "meets_rank0").read_text()) for job in (0, 1)]
    rank_1_started = [seen(app, job)[1]["started_at"] for job in (0, 1)]
    assert rank_1_started[0] >= meets[0], "rank 1 started before rank 0 reached the process group"
    assert rank_1_started[1] < meets[1] - 1, "start_ranks_together: rank 1 waited for rank 0"


def test_more_jobs_at_once_than_cores_each_wait_their_turn_and_the_sweep_completes(tmp_path):
    """3 one-rank jobs, n_jobs=2, on one core (taskset): the second job waits in its own agent for the
    core, saying so once, while the first ends and lets it go; the third then. Threads of one process
    under a lock hung here: a waiting job held the lock the finished one needed to end."""
    app = launcher_app(tmp_path / "app")
    command = ["taskset", "-c", "0", sys.executable, "app.py", "-m", "hydra.sweep.dir=sweep", *LAUNCHER]
    command += ["hydra.launcher.n_jobs=2", "devices=1", "lr=0.1,0.2,0.3"]
    run = Run(command, app, app_env()).wait(FAULT_BOUND)
    assert run.returncode == 0, run.text()[-6000:]
    assert [jobs(app)[job]["status"] for job in range(3)] == ["COMPLETED"] * 3
    assert run.text().count("waits for 1 free cpus") >= 1, run.text()[-3000:]
    assert "3 job(s), 0 failed" in run.text()


def test_a_sweep_that_touched_cuda_fails_a_closures_gpu_jobs_at_once_naming_the_fix(tmp_path):
    """Its ranks would be forks of the sweep's process, which called torch.cuda.is_available() (the app
    does, at import): a fork of it cannot use CUDA. Where this torch build has CUDA (CI's floor and newest
    stacks: PyPI's CUDA builds; no GPU needed)."""
    probe = (
        "import os, torch; torch.cuda.is_available(); pid = os.fork()\n"
        "if pid == 0: os._exit(10 + torch.cuda._is_in_bad_fork())\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
    )
    poisoned = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    poisoned = poisoned.stdout.strip()
    if poisoned != "11":
        pytest.skip(f"torch {torch.__version__}: a fork after torch.cuda.is_available() can use CUDA here")
    app = launcher_app(tmp_path / "app")
    env = {"LAUNCHER_APP_CLOSURE": "1", "LAUNCHER_APP_TOUCH_CUDA": "1"}
    gpu = "hydra.launcher.accelerator=gpu"  # a job on the CPU runs: its ranks never start CUDA
    run = start_sweep(app, *LAUNCHER, "hydra.launcher.nproc_per_node=2", gpu, "lr=0.1,0.2", env=env)
    run.wait(FAULT_BOUND)
    assert run.returncode != 0 and not list(app.glob("sweep/*/seen"))
    for job in (0, 1):
        assert jobs(app)[job]["status"] == "FAILED" and jobs(app)[job]["seconds"] < 10, jobs(app)[job]
        assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in jobs(app)[job]["error"], jobs(app)[job]["error"]


def test_the_fork_servers_death_is_named_its_ranks_end_with_it_and_the_next_job_gets_a_new_one(tmp_path):
    """SIGKILL to the fork server while job 0's ranks wait in a collective: they end with it at once
    (PR_SET_PDEATHSIG), the job fails naming the server, not as a rank 'killed by SIGKILL', and job 1's ranks
    come from a new server."""
    app = launcher_app(tmp_path / "app")
    sweep = start_sweep(app, *LAUNCHER, "hydra.launcher.nproc_per_node=2", "case=hang,plain")
    try:
        marks = [app / "sweep" / "0" / f"in_collective_rank{rank}" for rank in (0, 1)]
        wait_for(lambda: all(mark.exists() for mark in marks), FAULT_BOUND, "both ranks in the collective")
        ranks = [int(mark.read_text()) for mark in marks]
        server = int(Path(f"/proc/{ranks[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(server, signal.SIGKILL)
        wait_for(lambda: not any(alive(pid) for pid in ranks), 2, "job 0's ranks to end with the server")
        sweep.wait(FAULT_BOUND)
    finally:
        sweep.end()
    ended = jobs(app)
    assert ended[0]["status"] == "FAILED", sweep.text()[-4000:]
    assert f"The fork server (pid {server}) ended" in ended[0]["error"], ended[0]["error"]
    assert "killed by SIGKILL" not in ended[0]["error"].splitlines()[0]
    assert ended[1]["status"] == "COMPLETED", sweep.text()[-4000:]


def test_job_timeout_ends_a_hung_job_and_the_next_job_runs(sweeps):
    app, run = sweeps["timeout"]
    hung = jobs(app)[0]
    assert hung["status"] == "FAILED" and "job_timeout=10" in hung["error"], hung
    assert hung["seconds"] < FAULT_BOUND, hung  # the first job: the fork server starts in it too
    assert "most recent call first" in (app / "sweep" / "0" / "rank_1.log").read_text()  # where it stood
    assert jobs(app)[1]["status"] == "COMPLETED", run.text()[-3000:]


N_JOBS = ("hydra.launcher.n_jobs=2", "devices=1", "case=meet", "lr=0.1,0.2")


def test_n_jobs_run_jobs_at_once_on_cores_of_their_own(sweeps):
    app, run = sweeps["n_jobs"]
    assert [jobs(app)[job]["status"] for job in (0, 1)] == ["COMPLETED"] * 2, run.text()[-3000:]
    first, second = (set(seen(app, job)[0]["affinity"]) for job in (0, 1))
    assert not first & second, (first, second)


def test_sigterm_or_sigint_to_the_sweep_ends_every_running_rank(tmp_path):
    """Two sweeps at once, each in a job whose rank 0 waits in a collective for a rank 1 that sleeps: one
    gets SIGTERM (a scheduler), the other SIGINT (Ctrl-C reaching the sweep's process alone)."""
    signals = (signal.SIGTERM, signal.SIGINT)
    apps = [launcher_app(tmp_path / how.name) for how in signals]
    sweeps = [
        start_sweep(app, *LAUNCHER, "hydra.launcher.nproc_per_node=2", "case=hang,plain") for app in apps
    ]
    try:
        marks = [app / "sweep" / "0" / f"in_collective_rank{rank}" for app in apps for rank in (0, 1)]
        wait_for(lambda: all(mark.exists() for mark in marks), FAULT_BOUND, "every rank in its job")
        pids = [int(mark.read_text()) for mark in marks]
        for sweep, how in zip(sweeps, signals):
            sweep.proc.send_signal(how)
        for sweep in sweeps:
            sweep.wait(FAULT_BOUND)
    finally:
        for sweep in sweeps:
            sweep.end()
    assert all(sweep.returncode != 0 for sweep in sweeps)
    assert not [pid for pid in pids if alive(pid)]
    assert not [app for app in apps if Path(app / "sweep" / "1").exists()], "a sweep went on after the signal"


# What a user gets on Ctrl-C or SIGTERM (issue 64), as on the strategies' route (tests/test_faults.py): every
# rank's graceful shutdown (a callback's on_exception that takes 1.5 s), within the grace (15 s here: far
# above what they take, far below a hang's bound), then the sweep ends as the signal does.
GRACE = 15


@pytest.mark.parametrize("how", ["SIGINT to its process group", "SIGTERM to the sweep alone"])
def test_a_signal_gives_every_rank_its_graceful_shutdown_then_ends_the_sweep(tmp_path, how):
    app, job = launcher_app(tmp_path), tmp_path / "sweep" / "0"
    sweep = start_sweep(app, *LAUNCHER, "hydra.launcher.nproc_per_node=2", "case=interrupted,plain",
                        f"hydra.launcher.shutdown_grace={GRACE}")  # fmt: skip
    try:
        began = [job / f"training_rank{rank}" for rank in (0, 1)]
        wait_for(lambda: all(mark.exists() for mark in began), FAULT_BOUND, "both ranks of job 0 to train")
        stopped = time.monotonic()
        stop(sweep, how)
        sweep.wait(GRACE + 10)
        took = time.monotonic() - stopped
    finally:
        sweep.end()
    output, ran = assert_every_rank_shut_down_gracefully(job, how, sweep)
    name = "SIGINT (Ctrl-C)" if how.startswith("SIGINT") else "SIGTERM"
    assert f"The job was interrupted by {name} after" in jobs(app)[0]["error"], output[-6000:]
    assert not (tmp_path / "sweep" / "1").exists(), output[-6000:]
    print(f"{how}: on_exception ran: {ran}; the sweep exited {sweep.returncode} {took:.1f} s after it")


@pytest.mark.fsdp_cpu
def test_the_example_sweep_runs_under_the_launcher_to_the_losses_it_reaches_without_it(sweeps):
    """``python example_sweep.py -m hydra/launcher=hydra_fsdp`` (docs/launcher.md): rank 0 of each job,
    a fresh process, prints every rank's line to its log; the seeded model ends each lr at the loss the
    README shows for the strategy alone."""
    app, run = sweeps["example"]
    assert (
        "python example_sweep.py -m hydra/launcher=hydra_fsdp"
        in (APPS.parents[1] / "docs" / "launcher.md").read_text()
    )
    assert run.returncode == 0, run.text()[-6000:]
    reports = [
        m.groupdict()
        for job in (0, 1)
        for m in REPORT.finditer((app / "sweep" / str(job) / "rank_0.log").read_text())
    ]
    assert [(r["job"], r["rank"]) for r in reports] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], (
        reports
    )
    assert len({r["pid"] for r in reports}) == 4 and str(run.pid) not in {r["pid"] for r in reports}
    assert {(r["lr"], r["loss"]) for r in reports} == {("0.01", "2.0668"), ("0.05", "1.1482")}
    assert {r["strategy"] for r in reports} == {"HydraFSDP"}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_one_gpu_jobs_at_once_each_see_a_gpu_of_their_own(tmp_path):
    """CUDA_VISIBLE_DEVICES narrowed to the job's GPU: cuda:0 is each job's own, for any strategy."""
    app, meeting = launcher_app(tmp_path / "app"), tmp_path / "meeting"
    meeting.mkdir()
    run = start_sweep(app, *LAUNCHER, *N_JOBS, "accelerator=gpu", f"meet_in={meeting}").wait(SWEEP_TIMEOUT)
    assert run.returncode == 0, run.text()[-6000:]
    ranks = [seen(app, job)[0] for job in (0, 1)]
    assert [rank["root_device"] for rank in ranks] == ["cuda:0", "cuda:0"]
    visible = [rank["cuda_visible_devices"] for rank in ranks]
    assert len(set(visible)) == 2 and all("," not in gpus for gpus in visible), visible
    assert not any(entry["cuda_initialized"] for entry in jobs(app).values())
