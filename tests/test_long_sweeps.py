"""Long sweeps: every job starts as clean as the first in the sweep process, failed jobs included.

Rank 0 of every job is the sweep process, so whatever a job leaves there every later job inherits
(on a GPU: device memory). tests/apps/memory_app.py records at each job's start the bytes of live
tensors rank 0 holds, before and after a gc (Python's automatic gc is off in it), and whether the
last job's process group and backends are still alive.
"""

import functools
import importlib
import json
import shutil
import traceback

import hydra.core.utils
import pytest
import torch
from helpers import (
    APPS,
    FSDP_ON_CPU,
    MODEL_PARALLEL,
    MODEL_PARALLEL_REASON,
    run_app,
    run_side_by_side,
    start_sweep,
    started_pids,
)
from shared import nothing_outlives
from test_external import torchrun

import hydra_fsdp

MODEL_BYTES = 2 * (1600 * 1600 + 1600) * 4  # memory_app's Big: 20.5 MB
# torch 2.10 (FSDP2's floor on the CPU) keeps two DeviceMeshes of every FSDP2 job, 8 bytes and no process
# group, held from C++ by a (DTensorSpec,) tuple, found in no cache it clears (docs/reliability.md); 2.13 none
MESHES_TORCH_KEEPS_A_JOB = 2 if hydra_fsdp._release(torch.__version__) < (2, 13) else 0
LEFT_AT_MOST = MODEL_BYTES // 5  # what a job may leave: 20% of one model

# name: (the config's strategy, the fallback?, plan: each job's strategy and failure, see memory_app)
MIXED = ["full", "ddp:fail1", "sharded", "full:fail1", "ddp:fail0", "sharded:fail0", "ddp", "full"]
if not FSDP_ON_CPU:  # where Lightning refuses FSDP on the CPU: the same jobs, all of them HydraDDP
    MIXED = ["ddp" + job[len(job.split(":")[0]) :] for job in MIXED]
SWEEPS = {
    # a job of either strategy after a job of the other, each failing on rank 1 and on rank 0
    "HydraDDP and HydraFSDP": ("ddp", False, MIXED),
    # the children build the config's trainer: the strategy cannot vary by job
    "HydraFSDP, the config contract": ("fsdp", True, ["full", "full:fail1", "full:fail0", "full"]),
    # FSDP2's device meshes among what a job may leave
    "HydraModelParallel": ("ddp", False, ["fsdp2", "fsdp2:fail1", "fsdp2", "fsdp2:fail0", "fsdp2"]),
}


def memory_app(directory):
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(APPS / "memory_app.py", directory / "app.py")
    shutil.copy(APPS / "shapes.py", directory / "shapes.py")
    return directory


@pytest.fixture(scope="module")
def long_sweeps(tmp_path_factory):
    """Each sweep of SWEEPS that this Lightning runs on the CPU, the two side by side (a failed job
    waits for its ranks' ends, a core idle): {name: (app dir, run)}."""
    names = [name for name in SWEEPS if FSDP_ON_CPU or SWEEPS[name][0] != "fsdp"]
    names = [name for name in names if MODEL_PARALLEL or "fsdp2" not in SWEEPS[name][2][0]]
    apps, starts = [], []
    for name in names:
        strategy, fallback, plan = SWEEPS[name]
        apps.append(memory_app(tmp_path_factory.mktemp("long")))
        overrides = (f"plan=[{','.join(plan)}]", f"+n={','.join(map(str, range(len(plan))))}")
        env = {"APP_CLOSURE": "1"} if fallback else None
        starts.append(functools.partial(start_sweep, apps[-1], *overrides, strategy=strategy, env=env))
    with nothing_outlives("the long sweeps"):
        runs = run_side_by_side(starts, at_once=2)
    return dict(zip(names, zip(apps, runs)))


@pytest.mark.parametrize(
    "sweep",
    [
        pytest.param(
            name,
            marks=[pytest.mark.fsdp_cpu] * (SWEEPS[name][0] == "fsdp")
            + [pytest.mark.skipif(not MODEL_PARALLEL, reason=MODEL_PARALLEL_REASON)] * ("fsdp2" in plan[0]),
        )
        for name, (_, _, plan) in SWEEPS.items()
    ],
)
def test_every_job_starts_as_clean_as_the_first(long_sweeps, sweep):
    app, proc = long_sweeps[sweep]
    plan = SWEEPS[sweep][2]
    jobs = [app / "sweep" / str(job) for job in range(len(plan))]
    memory = [json.loads((job / "memory_rank0.json").read_text()) for job in jobs]
    table = " ".join(f"{m['before_gc'] / 1e6:.0f}/{m['after_gc'] / 1e6:.0f}" for m in memory)
    print(f"{sweep}: MB of live tensors at each job's start, before/after a gc: {table}")
    first = memory[0]["after_gc"]
    for job, (seen, planned) in enumerate(zip(memory, plan)):
        left = max(seen["before_gc"], seen["after_gc"]) - first
        assert left <= LEFT_AT_MOST, f"job {job} started holding {left / 1e6:.1f} MB more than job 0: {table}"
        assert not any(seen["group_alive_before_gc"]), f"job {job - 1}'s process group or backend is alive"
        # torch's DTensor caches would keep job 0's (with its process groups) for the rest of the sweep
        kept = MESHES_TORCH_KEEPS_A_JOB * job if "fsdp2" in planned else 0
        assert seen["device_meshes_before_gc"] <= kept, f"job {job} started with a DeviceMesh alive"
        assert not seen["process_group"]
        assert (jobs[job] / "done.json").exists() == ("fail" not in planned), f"job {job} ({planned})"
        # every child rank of every earlier job was gone as this job started, the sweep still running
        for earlier in jobs[:job]:
            left = {rank: pid for rank, pid in started_pids(earlier).items() if rank and pid in seen["alive"]}
            assert not left, (
                f"job {earlier.name}'s child ranks {left} were still running as job {job} started"
            )
    # rank 0's NCCL aborts rather than kills the sweep process; the children keep torch's defaults
    nccl = {rank: json.loads((jobs[0] / f"env_rank{rank}.json").read_text()) for rank in (0, 1)}
    assert nccl[0] == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "NCCL_ASYNC_ERROR_HANDLING": None,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }
    assert nccl[1] == dict.fromkeys(nccl[1])
    # what a failed job printed kept the error and the lines of the task function that raised it
    assert proc.returncode != 0 and "Child rank 1 failed" in proc.text()
    assert "injected failure on rank 1" in proc.text() and 'app.py", line' in proc.text()


@pytest.mark.fsdp_cpu
def test_under_torchrun_every_rank_lets_go_of_each_job(tmp_path):
    """Under torchrun (and SLURM) every rank is a sweep process of its own: each frees each job's end."""
    app = memory_app(tmp_path)
    codes, output, _ = torchrun(app, "plan=[full,sharded,full]", "+n=0,1,2", strategy="fsdp")
    assert codes == [0], output[-6000:]
    for rank in (0, 1):
        memory = [
            json.loads((app / "sweep" / str(job) / f"memory_rank{rank}.json").read_text()) for job in range(3)
        ]
        table = " ".join(f"{m['before_gc'] / 1e6:.0f}/{m['after_gc'] / 1e6:.0f}" for m in memory)
        print(f"torchrun, rank {rank}: MB of live tensors at each job's start, before/after a gc: {table}")
        for job, seen in enumerate(memory):
            left = max(seen["before_gc"], seen["after_gc"]) - memory[0]["after_gc"]
            assert left <= LEFT_AT_MOST, f"rank {rank}, job {job}: {table}"


def test_a_failed_job_keeps_its_error_and_a_returned_module_its_weights(tmp_path, monkeypatch, capsys):
    """In this process (rank 0 of a hydra_zen.launch sweep): what Hydra, and a user's callback, keep of
    each job once it ended. HydraFSDP, or HydraDDP where Lightning refuses FSDP on the CPU."""
    monkeypatch.setenv(hydra_fsdp.LAUNCH_DELAY_ENV, "0")
    monkeypatch.setenv("APP_STRATEGY", "fsdp" if FSDP_ON_CPU else "ddp")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    memory_app(tmp_path)
    (tmp_path / "app.py").rename(tmp_path / "memapp.py")
    memapp = importlib.import_module("memapp")
    from hydra_zen import launch

    job = "full" if FSDP_ON_CPU else "ddp"
    overrides = [
        f"plan=[{job}:fail1,{job}:return]",
        "+n=0,1",
        "+hydra.callbacks.keep._target_=memapp.KeepReturns",
    ]
    try:
        with pytest.raises(
            hydra_fsdp.ChildRankError
        ) as raised:  # Hydra raises the failed job's error at the end
            launch(
                memapp.Config,
                memapp.task,
                overrides=[*overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                multirun=True,
                version_base="1.3",
            )
    finally:
        hydra_fsdp._sweep.on_run_end(config=None)  # Hydra ends no sweep that raised: end it as Hydra would
    failed, returned = memapp.KEPT
    error = failed._return_value
    assert error is raised.value and failed.status.name == "FAILED"
    # its cause, rank 0's broken collective, the frames of the job let go of, their text kept. hydra-core
    # 1.4 raises a failed job's error whose traceback is gone with its traceback and its cause made again
    # from the text it kept (synthetic frames, classes of those names); the real cause is its context.
    cause, hydra_keeps_the_text = error.__context__, hasattr(hydra.core.utils, "_run_job")
    assert "Child rank 1 failed" in str(error)
    for chained in (cause, error.__cause__):
        assert "RuntimeError" in {kind.__name__ for kind in type(chained).__mro__}, repr(chained)
    assert cause.__traceback__ is None
    if hydra_keeps_the_text:
        text = "".join(traceback.format_exception(error))
    else:  # the sweeper's raise gave the error a traceback of its own, which holds no frame of the job
        assert cause is error.__cause__
        assert all(frame.f_code.co_name != "task" for frame, _ in traceback.walk_tb(error.__traceback__))
        text = (getattr(error, "__notes__", None) or [capsys.readouterr().err])[-1]  # 3.10: printed
    assert "Traceback (most recent call last):" in text and "memapp.py" in text and "in task" in text
    module = returned.return_value  # the user's code holds it: its weights stay as trained
    held = [p.detach() for p in module.parameters()]
    assert sum(p.numel() for p in held) > 0
    assert float(sum(p.double().sum() for p in held)) == pytest.approx(module.trained_sum, rel=1e-9)
    assert not torch.distributed.is_initialized()


def two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs: NCCL refuses two ranks on one")
def test_two_gpu_nccl_a_rank_out_of_memory_fails_only_its_job(tmp_path):
    """NCCL reports no dead peer within a node: without the abort, rank 0 would wait out the group's
    timeout (30 min) and torch would then kill the sweep process. The sweep's timeout bounds it here."""
    app = memory_app(tmp_path)
    plan = ["ddp:oom1", "ddp", "ddp:oom0", "full"]
    proc = run_app(
        app, "hydra.sweep.dir=sweep", f"plan=[{','.join(plan)}]", "+n=0,1,2,3", "trainer.accelerator=gpu"
    )
    assert proc.returncode != 0 and "Child rank 1 failed" in proc.text() and "out of memory" in proc.text()
    memory = [
        json.loads((app / "sweep" / str(job) / "memory_rank0.json").read_text()) for job in range(len(plan))
    ]
    print("cuda bytes allocated at each job's start, after a gc:", [m["cuda_allocated"] for m in memory])
    for job, planned in enumerate(plan):
        assert (app / "sweep" / str(job) / "done.json").exists() == ("oom" not in planned), f"job {job}"
        seen = memory[job]
        assert max(seen["cuda_allocated_before_gc"], seen["cuda_allocated"]) <= LEFT_AT_MOST, (
            f"job {job}: {seen}"
        )
        assert not any(seen["group_alive_before_gc"])
