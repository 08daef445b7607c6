"""Lightning's own DeepSpeedStrategy, ZeRO-2 and ZeRO-3, under ``hydra/launcher=hydra_fsdp``: one real sweep
of tests/apps/launcher_app.py, ``strategy=deepspeed2,deepspeed3 lr=0.1,0.2`` (4 jobs x 2 ranks, CPU, gloo),
each job's ranks fresh processes, so that DeepSpeed's process-wide state (its groups, ZeRO-3's module and
parameter counters) never meets a second job. On the CPU through a test-only subclass of the app
(``cpu_deepspeed``: Lightning refuses a non-CUDA accelerator by type); the engine is DeepSpeed's own."""

import functools
import importlib.util

import pytest
from helpers import run_side_by_side, start_sweep
from shared import nothing_outlives
from test_launcher import LAUNCHER, jobs, launcher_app, seen

# Found, not imported: `import deepspeed` sets PYTORCH_NVML_BASED_CUDA_CHECK=1 in this process's environment,
# which every later sweep of this test process would inherit. (Not installed on CI's floor and newest stacks.)
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("pip install deepspeed (the test extras)", allow_module_level=True)

STAGES = (2, 3)
LRS = (0.1, 0.2)
# Hydra's job order: the first override's values outermost
JOBS = {(stage, lr): n for n, (stage, lr) in enumerate((s, lr) for s in STAGES for lr in LRS)}
OPTIMIZERS = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The sweep, run to its end: (app dir, run)."""
    app = launcher_app(tmp_path_factory.mktemp("deepspeed"))
    start = functools.partial(
        start_sweep,
        app,
        *LAUNCHER,
        "hydra.launcher.nproc_per_node=2",
        f"strategy={','.join(f'deepspeed{stage}' for stage in STAGES)}",
        f"lr={','.join(map(str, LRS))}",
    )
    with nothing_outlives("the DeepSpeed sweep"):
        (run,) = run_side_by_side([start], at_once=1)
    return app, run


def test_every_job_trains_under_deepspeed_with_its_zero_stage_every_rank_a_fresh_process(sweep):
    app, run = sweep
    assert run.returncode == 0, run.text()[-6000:]
    ended = jobs(app)
    assert sorted(ended) == sorted(JOBS.values()), run.text()[-3000:]
    assert f"{len(JOBS)} job(s), 0 failed" in run.text()
    pids = set()
    for (stage, lr), job in JOBS.items():
        assert ended[job]["status"] == "COMPLETED", ended[job]["error"]
        ranks = seen(app, job)
        assert sorted(ranks) == [0, 1], (job, ranks)
        assert ended[job]["value"] == ranks[0], "the job's value is rank 0's return value"
        for rank, record in ranks.items():
            assert (record["global_rank"], record["world"], record["lr"]) == (rank, 2, lr)
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
            assert record["env"] == env
            # the engine this rank trained with, as DeepSpeed reports it
            assert (record["strategy"], record["engine"]) == ("CPUDeepSpeed", "DeepSpeedEngine")
            assert (record["zero_stage"], record["optimizer"]) == (stage, OPTIMIZERS[stage]), (job, record)
            # ZeRO-3 partitions the weights, a shard of each parameter a rank (the weight's 4 values: 2;
            # the bias's 1, padded to 2: 1), no rank holding them whole outside a forward; ZeRO-2 does not
            assert (record["local_numel"], record["shard_numel"]) == ((0, 3) if stage == 3 else (5, 0))
            assert len(record["losses"]) == 6, "3 epochs x 2 steps (32 samples, batch 8, 2 ranks)"
            assert record["tasks_run_here"] == 1, "a rank runs one job's task function, in its own process"
            assert record["pid"] != ended[job]["sweep_pid"]
            pids.add(record["pid"])
        assert ended[job]["tasks_run_here"] == 0, "the task function ran in the sweep's process"
        assert ended[job]["process_group"] is False
    assert len(pids) == 2 * len(JOBS), "every rank of every job is a process of its own"


@pytest.mark.parametrize("lr", LRS)
def test_zero_2_and_zero_3_train_to_the_same_losses(sweep, lr):
    """Step by step on each rank, exactly: the same seed, data and SGD; with 2 ranks each gradient is the mean
    of 2 values, a sum that no reduction order changes and a halving that rounds nothing, so where ZeRO-2
    and ZeRO-3 keep and exchange the values must not change one bit of the losses."""
    app, _ = sweep
    zero2, zero3 = (seen(app, JOBS[stage, lr]) for stage in STAGES)
    for rank in (0, 1):
        assert zero2[rank]["losses"] == zero3[rank]["losses"], (rank, zero2[rank], zero3[rank])
    assert zero2[0]["losses"][-1] < zero2[0]["losses"][0] / 2, ("it learns", zero2[0]["losses"])


def test_losses_differ_between_lrs(sweep):
    app, _ = sweep
    for stage in STAGES:
        first, second = (seen(app, JOBS[stage, lr]) for lr in LRS)
        for rank in (0, 1):
            assert first[rank]["losses"][0] == second[rank]["losses"][0], "the same weights at the start"
            assert first[rank]["losses"][-1] != second[rank]["losses"][-1], (stage, rank, first[rank])
