"""End to end: real sweeps with real child processes on CPU; assert what every rank saw. At the end, the
soaks (slow), which repeat two of these sweeps at length."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    FSDP_ON_CPU,
    LIGHTNING,
    RECORD_ALIVE,
    alive,
    assert_failed_job_then_healthy_job,
    assert_ranks_agree,
    copy_app,
    ok,
    records,
    run_app,
    start_sweep,
    started_pids,
    sweep_in,
    wait_all,
    wait_for,
)
from shared import case_overrides, nothing_outlives

import hydra_fsdp

# One sweep of each strategy serves the tests below that need a job of theirs, each job the
# scenario of one test (the overrides its own sweep had), in <sweep>/<case>: two sweeps instead of
# nine. Scenarios whose sweep-wide settings differ (the sweep dir, the environment, a job that fails)
# keep a sweep of their own.
CHECKPOINTED = {"trainer.enable_checkpointing": True, "trainer.callbacks": ["${keep_last}"]}
SAME_MODULE = {  # test_fit_then_test_the_same_module, one per ckpt_path
    "same_none": {"stages": ["fit", "test:same:none"]},
    # two epochs, the first one "best": loading it is told apart from loading last, or nothing
    "same_best": {
        "trainer.enable_checkpointing": True,
        "trainer.callbacks": ["${best_is_first}", "${keep_last}"],
        "trainer.max_epochs": 2,
        "stages": ["fit", "test:same:best"],
    },
}
SEED = {"module.seed": 0}  # the same initial weights: HydraFSDP's shards, compared with DDP's weights
CASES = {
    "ddp": {
        "stages_datamodule": {
            "stages": ["validate", "test", "predict"],
            "use_datamodule": True,
            "module.lr": 0.3,
        },
        "fit_test": {"stages": ["fit", "test"]},
        **{
            f"loaders_{lr}": {
                "loaders_in_call": True,
                "stages": ["fit", "validate", "test", "predict"],
                "module.lr": lr,
                **SEED,
            }
            for lr in (0.1, 0.2)
        },
        **SAME_MODULE,
        # two jobs: the second's children must not work where the first's did (the fork server's cwd)
        **{
            f"chdir_{lr}": {"hydra.job.chdir": True, "write_relative": True, "module.lr": lr}
            for lr in (0.1, 0.2)
        },
    },
    "fsdp": {
        **{f"shards_{lr}": {"module.lr": lr, **SEED} for lr in (0.1, 0.2)},
        "checkpoint": {**CHECKPOINTED, "stages": ["fit", "test:fresh:last", "validate:fresh:best"]},
        **SAME_MODULE,
    },
}


@pytest.fixture(scope="module")
def shared_sweep(tmp_path_factory):
    """``shared_sweep(strategy)``: that strategy's shared sweep, {case: job dir}, and its run.
    The first call starts both sweeps side by side (two sweeps at once on one machine, as the soak
    test_soak_two_sweeps_at_once_on_one_machine runs longer), the FSDP one where FSDP runs on the CPU."""
    sweeps = {}

    def sweep(strategy):
        if not sweeps:
            strategies = ("ddp", "fsdp") if FSDP_ON_CPU else ("ddp",)
            apps = {name: copy_app(tmp_path_factory.mktemp(f"shared_{name}")) for name in strategies}
            with nothing_outlives("the shared sweeps"):
                runs = {
                    name: start_sweep(
                        app, *case_overrides(app / "conf", CASES[name]), env={"APP_STRATEGY": name}
                    )
                    for name, app in apps.items()
                }
                wait_all(runs.values())
            for name, app in apps.items():
                sweeps[name] = {case: app / "sweep" / case for case in CASES[name]}, runs[name]
        jobs, run = sweeps[strategy]
        return jobs, ok(run)

    return sweep


def ports_and_times(job_dirs):
    """{job dir: (its port, when its ranks first started, when they last recorded)}: a span within the
    time the job held its port."""
    found = {}
    for job in job_dirs:
        seen = [json.loads(p.read_text()) for p in (job / "seen").glob("*_rank*.json")]
        ports = {rank["master_port"] for rank in seen}
        assert len(ports) == 1 and None not in ports, (job, ports)  # one process group a job
        began = min(p.stat().st_mtime for p in (job / "started").glob("rank*.json"))
        found[job] = ports.pop(), began, max(rank["time"] for rank in seen)
    return found


def assert_no_port_shared_at_once(sweeps):
    """Within a sweep, every job on a port of its own (torch caches a store by port); across sweeps
    run side by side, no two jobs on one port while both ran. (The OS offers a port again once it is
    free: two sweeps' jobs one after the other on one port are fine.)"""
    spans = {}
    for job_dirs in sweeps:
        found = ports_and_times(job_dirs)
        ports = [port for port, _, _ in found.values()]
        assert len(set(ports)) == len(ports), f"jobs of one sweep on one port: {found}"
        spans.update(found)
    for a, (port, began, ended) in spans.items():
        for b, (other_port, other_began, other_ended) in spans.items():
            if a != b and port == other_port:
                assert ended < other_began or other_ended < began, f"{a} and {b} on port {port} at once"


@pytest.mark.fsdp_cpu
def test_two_sweeps_at_once_share_no_port(shared_sweep):
    """The shared DDP and FSDP sweeps ran side by side: no two of their jobs met on one port."""
    assert_no_port_shared_at_once([list(shared_sweep(strategy)[0].values()) for strategy in ("ddp", "fsdp")])


def test_under_hydra_job_chdir_every_rank_works_in_its_jobs_dir(shared_sweep):
    """hydra.job.chdir=True: every rank of each job works in that job's dir, rank 0 by Hydra's chdir, a
    child by hydra_fsdp's (it is forked from a server that works elsewhere): its relative paths land
    there."""
    jobs, _ = shared_sweep("ddp")
    for case in ("chdir_0.1", "chdir_0.2"):
        job_dir = jobs[case]
        app = job_dir.parent.parent
        seen = assert_ranks_agree(job_dir)
        for rank in (0, 1):
            assert seen[rank]["cwd"] == str(job_dir) and seen[rank]["original_cwd"] == str(app), (case, rank)
            written = job_dir / f"relative_rank{rank}.txt"
            assert written.is_file(), f"rank {rank} wrote its relative path elsewhere than {job_dir}"
            assert written.read_text() == str(job_dir)
    # and nowhere else: not in the app's dir, where the sweep started, nor in another job's
    written = sorted(path.parent.name for path in app.rglob("relative_rank*.txt"))
    assert written == ["chdir_0.1"] * 2 + ["chdir_0.2"] * 2, written


# HydraDDP


NOTE = "a=b,[c] $x {y} w\\\\v"  # in the job dirs' names: the job's overrides name its subdir
DEFAULT_DIR_LRS = (0.1, 0.2, 0.3)  # the job dirs' order too: their names differ there
PER_JOB_ENV = (
    "+hydra.job.env_set.JOB_TAG=job_${hydra:job.num}",
    "+hydra.job.env_set.OMP_NUM_THREADS='${plus:${hydra:job.num},1}'",
)


@pytest.fixture(scope="module")
def default_dir_sweep(tmp_path_factory):
    """One HydraDDP sweep into Hydra's default timestamped sweep dir, each job's subdir named by its
    overrides, special characters among them, an environment of its own set for each job: the app
    dir, the sweep dir, its job dirs (by lr) and run."""
    app = copy_app(tmp_path_factory.mktemp("default_dir"))
    overrides = (
        "hydra.sweep.subdir=${hydra.job.override_dirname}",
        f"module.lr={','.join(map(str, DEFAULT_DIR_LRS))}",
        f"+note='{NOTE}'",
        *PER_JOB_ENV,
    )
    with nothing_outlives("the sweep into Hydra's default dirs"):
        proc = ok(run_app(app, *overrides))
    sweep_dirs = [p for p in (app / "multirun").glob("*/*") if p.is_dir()]
    assert len(sweep_dirs) == 1, f"expected one sweep dir, found {sweep_dirs}"
    job_dirs = sorted(p for p in sweep_dirs[0].iterdir() if p.is_dir())
    assert len(job_dirs) == len(DEFAULT_DIR_LRS), job_dirs
    return app, job_dirs, proc


def test_ddp_sweep_every_rank_trains_its_own_job(default_dir_sweep):
    app, job_dirs, proc = default_dir_sweep
    ports = set()
    for job, (job_dir, lr) in enumerate(zip(job_dirs, DEFAULT_DIR_LRS)):
        seen = assert_ranks_agree(job_dir)
        assert seen[0]["lr"] == lr and seen[0]["job"] == job and seen[0]["tag"] == job_dir.name
        assert seen[0]["cwd"] == str(app) and seen[0]["original_cwd"] == str(app)
        assert seen[0]["params_held"] == seen[0]["params_total"]  # DDP replicates
        assert seen[0]["weight_sum"] == seen[1]["weight_sum"]  # and keeps replicas equal
        assert seen[0]["strategy"] == "hydra_fsdp.HydraDDP"
        ports.add(seen[1]["master_port"])
        # rank 0's saved config is Hydra's own, untouched; the child's output went to its log
        assert "_target_: __main__.Tiny" in (job_dir / ".hydra" / "config.yaml").read_text()
        assert "GLOBAL_RANK: 1" in (job_dir / "rank_1.log").read_text()
    assert len(ports) == len(job_dirs), "each job must rendezvous on its own port"
    print(f"{len(job_dirs)} jobs x 2 ranks, HydraDDP: {proc.seconds:.1f} s")


def test_every_job_gets_fresh_child_processes(default_dir_sweep):
    """Forked by one fork server per sweep (see _ForkServer), a child rank still has what a fresh
    process has of its own: a new pid per rank per job, module state at its initial value, the job's
    environment in force (``hydra.job.env_set``, ``OMP_NUM_THREADS`` too), its own random numbers,
    Lightning's rank. (That the server ends with the sweep, however it ends: tests/test_faults.py.)"""
    job_dirs = default_dir_sweep[1]
    rank0 = [records(job_dir)[0] for job_dir in job_dirs]
    child = [records(job_dir)[1] for job_dir in job_dirs]
    assert len({c["pid"] for c in child}) == 3, "a new process for every job"
    servers = {c["ppid"] for c in child}
    assert len(servers) == 1 and servers != {rank0[0]["pid"]}, "forked by one fork server, not by rank 0"
    assert [c["jobs_run_here"] for c in child] == [1, 1, 1], "module state starts afresh in every job"
    assert [r["jobs_run_here"] for r in rank0] == [1, 2, 3]  # rank 0 is the sweep's own process
    assert [c["job_tag"] for c in child] == ["job_0", "job_1", "job_2"]
    assert [c["threads"] for c in child] == [1, 2, 3], "the job's OMP_NUM_THREADS in force"
    # its own random numbers, numpy's and torch's: not the fork server's, not rank 0's
    for generator in ("numpy_draw", "torch_draw"):
        draws = [(r[generator], c[generator]) for r, c in zip(rank0, child)]
        assert len({c for _, c in draws}) == 3 and all(r != c for r, c in draws), (generator, draws)
    assert [c["rank_zero_only_rank"] for c in child] == [1, 1, 1] and rank0[0]["rank_zero_only_rank"] == 0
    for job in range(3):
        assert rank0[job]["weight_sum"] == child[job]["weight_sum"]
    wait_for(lambda: not alive(servers.pop()), 10, "the fork server to end with the sweep")


def test_single_run_without_multirun(app):
    ok(run_app(app, "hydra.run.dir=single", multirun=False))
    assert_ranks_agree(app / "single")


def test_job_dir_full_of_special_characters(default_dir_sweep):
    for job_dir, lr in zip(default_dir_sweep[1], DEFAULT_DIR_LRS):
        assert all(c in job_dir.name for c in "=,[]${}\\ ") and f"module.lr={lr}" in job_dir.name, (
            job_dir.name
        )
        seen = assert_ranks_agree(job_dir)
        assert seen[1]["output_dir"] == str(job_dir)


def test_stages_validate_test_predict_with_a_datamodule(shared_sweep):
    job = shared_sweep("ddp")[0]["stages_datamodule"]
    for stage in ("validate", "test", "predict"):
        seen = assert_ranks_agree(job, stage)
        assert {r["datamodule"] for r in seen.values()} == {"Shapes"}
        # every rank evaluates rank 0's weights, though each built its own module
        assert seen[0]["weight_sum"] == seen[1]["weight_sum"]


def test_fit_then_test_on_one_trainer_evaluates_rank0_weights(shared_sweep):
    job = shared_sweep("ddp")[0]["fit_test"]
    fit, tested = records(job, "fit"), assert_ranks_agree(job, "test")
    assert tested[0]["weight_sum"] == tested[1]["weight_sum"] == fit[0]["weight_sum"]
    assert fit[1]["pid"] == tested[1]["pid"], "one child process runs the whole job"
    assert (job / "rank_1.log").read_text().count("GLOBAL_RANK: 1") == 1  # one process group


def test_dataloaders_passed_straight_to_the_stages(shared_sweep):
    jobs = shared_sweep("ddp")[0]
    for job in ("loaders_0.1", "loaders_0.2"):
        for stage in ("fit", "validate", "test", "predict"):
            seen = assert_ranks_agree(jobs[job], stage)
            assert seen[0]["weight_sum"] == seen[1]["weight_sum"] and seen[0]["datamodule"] is None


def test_a_closure_task_function_falls_back_to_the_config_contract(app):
    proc = ok(
        sweep_in(
            app, "module.lr=0.1,0.2", "stages=[fit,test]", "use_datamodule=true", env={"APP_CLOSURE": "1"}
        )
    )
    reason = [line for line in proc.text().splitlines() if "[hydra_fsdp][WARNING]" in line]
    assert len(reason) == 2, reason  # one line a job
    assert (
        "child ranks build the config's trainer and module, because the task function cannot be pickled"
        in reason[0]
    )
    for job, lr in (("0", 0.1), ("1", 0.2)):
        for stage in ("fit", "test"):
            seen = assert_ranks_agree(app / "sweep" / job, stage)
            assert seen[1]["lr"] == lr and seen[1]["datamodule"] == "Shapes"
            assert seen[0]["weight_sum"] == seen[1]["weight_sum"]


# --------------------------------------------------------------------------- end to end: HydraFSDP


@pytest.mark.fsdp_cpu
def test_fsdp_sweep_shards_parameters_on_cpu(shared_sweep):
    jobs, proc = shared_sweep("fsdp")
    for lr in (0.1, 0.2):
        seen = assert_ranks_agree(jobs[f"shards_{lr}"])
        total = seen[0]["params_total"]
        held = [seen[r]["params_held"] for r in (0, 1)]
        assert sum(held) == total and all(abs(h - total / 2) <= 1 for h in held), (held, total)
        assert seen[0]["strategy"] == "hydra_fsdp.HydraFSDP" and seen[0]["lr"] == lr
        # each rank holds its part of the weights DDP trains from the same start on the same batches
        ddp = records(shared_sweep("ddp")[0][f"loaders_{lr}"])[0]["shards_should_hold"]["flat"]
        for rank in (0, 1):
            assert seen[rank]["local_weight_sum"] == pytest.approx(ddp[rank], rel=1e-5, abs=1e-4), (rank, ddp)
    print(f"{len(jobs)} jobs x 2 ranks, HydraFSDP: {proc.seconds:.1f} s")


@pytest.mark.fsdp_cpu
def test_fsdp_checkpoint_saves_and_loads_on_cpu(shared_sweep):
    job = shared_sweep("fsdp")[0]["checkpoint"]
    fit = records(job, "fit")
    checkpoints = {p.name for p in (job / "checkpoints").iterdir()}
    assert "last.ckpt" in checkpoints and len(checkpoints) == 2, checkpoints
    for stage in ("test", "validate"):
        seen = assert_ranks_agree(job, stage)
        # the checkpoint holds the trained weights; every rank loaded its shard of them into a fresh
        # module (whose own initial weights differ: loading nothing would show)
        for rank in (0, 1):
            assert seen[rank]["local_weight_sum"] == pytest.approx(fit[rank]["local_weight_sum"], rel=1e-6)
        assert seen[0]["weight_sum"] == pytest.approx(fit[0]["weight_sum"], rel=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("ckpt", ["none", "best"])
def test_fit_then_test_the_same_module(shared_sweep, strategy, ckpt):
    # Lightning's own FSDPStrategy wraps the sharded module again here and fails (its issue #19015)
    job = shared_sweep(strategy)[0][f"same_{ckpt}"]
    fit, tested = records(job, "fit"), assert_ranks_agree(job, "test")
    # none: the trained weights; best: the first epoch's (see SAME_MODULE), not the last's
    expected = fit if ckpt == "none" else records(job, "epoch0")
    for rank in (0, 1):  # the trained module, on the same process, holding the same shard
        assert (
            tested[rank]["pid"] == fit[rank]["pid"]
            and tested[rank]["params_held"] == fit[rank]["params_held"]
        )
        if ckpt == "best":
            assert expected[rank]["local_weight_sum"] != pytest.approx(fit[rank]["local_weight_sum"])
        assert tested[rank]["local_weight_sum"] == pytest.approx(
            expected[rank]["local_weight_sum"], rel=1e-6
        ), (rank, ckpt)
    if strategy == "ddp":  # each its full copy, the same
        assert tested[0]["local_weight_sum"] == pytest.approx(tested[1]["local_weight_sum"], rel=1e-9)


# --------------------------------------------------------------------------- where targets live


def test_hydra_zen_launch_multirun_from_python(tmp_path, monkeypatch):
    monkeypatch.setenv(hydra_fsdp.LAUNCH_DELAY_ENV, "0")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    copy_app(tmp_path)
    (tmp_path / "app.py").rename(tmp_path / "lzapp.py")
    monkeypatch.setenv("APP_STRATEGY", "ddp")
    import importlib

    from hydra_zen import launch

    lzapp = importlib.import_module("lzapp")
    jobs = launch(
        lzapp.Config,
        lzapp.task,
        overrides=["module.lr=0.1,0.2", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        multirun=True,
        version_base="1.3",
    )
    assert [job.status.name for job in jobs[0]] == ["COMPLETED", "COMPLETED"]
    for job, lr in ((0, 0.1), (1, 0.2)):
        seen = assert_ranks_agree(tmp_path / "sweep" / str(job))
        assert seen[1]["lr"] == lr and seen[1]["job"] == job
    assert not torch.distributed.is_initialized()
    for key in hydra_fsdp._RENDEZVOUS_ENV:
        assert key not in os.environ


@pytest.mark.fsdp_cpu
def test_copied_into_a_user_package(app):
    third_party = app / "myproj" / "third_party"
    third_party.mkdir(parents=True)
    for package in (app / "myproj", third_party):
        (package / "__init__.py").write_text("")
    (third_party / "hydra_fsdp.py").write_text(Path(hydra_fsdp.__file__).read_text())
    target = "myproj.third_party.hydra_fsdp.HydraFSDP"
    ok(run_app(app, "hydra.sweep.dir=sweep", "module.lr=0.1", f"trainer.strategy._target_={target}"))
    seen = assert_ranks_agree(app / "sweep" / "0")
    assert seen[1]["strategy"] == target  # the children ran the copy


# --------------------------------------------------------------------------- bad input, end to end


@pytest.mark.skipif(FSDP_ON_CPU, reason=f"Lightning {LIGHTNING} runs FSDP on the CPU")
def test_fsdp_on_a_lightning_that_refuses_the_cpu_fails_fast_naming_the_release(app):
    proc = sweep_in(app, "module.lr=0.1,0.2", strategy="fsdp", timeout=120)
    assert proc.returncode != 0
    assert "HydraFSDP without a GPU needs" in proc.text() and ">=2.3.0 (found" in proc.text(), proc.text()[
        -3000:
    ]
    assert not (app / "sweep" / "0" / "rank_1.log").exists()
    assert proc.seconds < 60


def test_bad_input_fails_fast_and_leaves_no_process(app):
    proc = sweep_in(app, "module.lr=0.1,0.2", env={"MUSHIN_DDP_LAUNCH_DELAY": "soon"}, timeout=120)
    assert proc.returncode != 0
    assert "MUSHIN_DDP_LAUNCH_DELAY='soon' is not a number of seconds" in proc.text()
    for job in ("0", "1"):
        assert not (app / "sweep" / job / "rank_1.log").exists()
    assert proc.seconds < 60


# --------------------------------------------------------------------------- 2 GPUs


def two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gpu_sweep(app, strategy):
    ok(
        sweep_in(
            app,
            "module.lr=0.1,0.2",
            "trainer.accelerator=gpu",
            "trainer.enable_checkpointing=true",
            "stages=[fit,test:fresh:last]",
            strategy=strategy,
        )
    )
    for job in ("0", "1"):
        seen = assert_ranks_agree(app / "sweep" / job)
        if strategy == "fsdp":
            assert sum(r["params_held"] for r in seen.values()) == seen[0]["params_total"]
        assert_ranks_agree(app / "sweep" / job, "test")


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")
def test_two_gpu_rank0_outlives_a_timed_out_nccl_collective(app):
    """Rank 1 hangs in training: rank 0's NCCL collective times out (the group's timeout, 5 s), and its
    watchdog, under TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (torch's CleanUpOnly), aborts the communicators and
    keeps the process, the sweep's: the job fails, the next one trains. (torch's default, 3, ends the
    process: the sweep with it; 0 aborts nothing: rank 0 would wait on the GPU for ever.)"""
    proc = sweep_in(
        app,
        "module.lr=0.1,0.2",
        "trainer.accelerator=gpu",
        "module.fail_rank=1",
        "module.fail_how=train_hang",
        "trainer.strategy.timeout.seconds=5",
        RECORD_ALIVE,
    )
    assert_failed_job_then_healthy_job(app, proc, 1, expect_in_error=["child ranks were still running"])


# --------------------------------------------------------------------------- soak


@pytest.mark.slow
def test_soak_sixteen_jobs(app):
    lrs = ",".join(str(i / 100) for i in range(1, 17))
    proc = ok(sweep_in(app, f"module.lr={lrs}", timeout=900))
    ports = set()
    for job in range(16):
        seen = assert_ranks_agree(app / "sweep" / str(job))
        assert seen[0]["lr"] == (job + 1) / 100 and seen[1]["job"] == job
        ports.add(seen[1]["master_port"])
        assert all(not alive(pid) for pid in started_pids(app / "sweep" / str(job)).values())
    assert len(ports) == 16
    print(f"16 jobs x 2 ranks: {proc.seconds:.1f} s")


@pytest.mark.slow
def test_soak_two_sweeps_at_once_on_one_machine(tmp_path):
    apps = [copy_app(tmp_path / name) for name in ("a", "b")]
    lrs = ",".join(str(i / 100) for i in range(1, 9))
    started = time.monotonic()
    sweeps = [start_sweep(app_dir, f"module.lr={lrs}") for app_dir in apps]
    wait_all(sweeps, timeout=900)
    for sweep in sweeps:
        ok(sweep)
    for app_dir in apps:
        for job in range(8):
            assert_ranks_agree(app_dir / "sweep" / str(job))
    assert_no_port_shared_at_once([[app_dir / "sweep" / str(job) for job in range(8)] for app_dir in apps])
    print(f"2 concurrent sweeps of 8 jobs x 2 ranks: {time.monotonic() - started:.1f} s")
