"""HydraModelParallel (Lightning's ModelParallelStrategy: FSDP2, tensor parallelism) in real sweeps of
2 jobs x 2 CPU ranks: what each rank held, its checkpoints, and the mistakes it names."""

import functools
import sys

import helpers
import pytest
import torch
from helpers import (
    MODEL_PARALLEL,
    MODEL_PARALLEL_REASON,
    app_env,
    assert_failed_job_then_healthy_job,
    assert_ranks_agree,
    copy_app,
    ok,
    records,
    run_app,
    run_side_by_side,
    start_sweep,
    sweep_in,
)
from test_external import torchrun

pytestmark = pytest.mark.skipif(
    not MODEL_PARALLEL,
    reason=MODEL_PARALLEL_REASON,
)
FSDP2 = ("+trainer.strategy.data_parallel_size=2", "+trainer.strategy.tensor_parallel_size=1")
CHECKPOINTED = ("trainer.enable_checkpointing=true", "trainer.callbacks=[${keep_last}]")


def sweep(app, *overrides):
    return sweep_in(app, *overrides, strategy="model_parallel")


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed checkpoint", "full checkpoint"])
def test_each_rank_holds_its_shard_and_fit_test_best_resume_last_run_on_one_set_of_ranks(app, distributed):
    # SGD without momentum: a full checkpoint of it is one Lightning alone cannot load (IndexError)
    proc = ok(
        sweep(
            app,
            "module.lr=0.1,0.2",
            *FSDP2,
            f"+trainer.strategy.save_distributed_checkpoint={distributed}",
            *CHECKPOINTED,
            "stages=[fit,test:same:best,fit:fresh:last]",
        )
    )
    assert proc.text().count("Launching 2 jobs locally") == 1, "the sweep ran once, not once a rank"
    for job, lr in (("0", 0.1), ("1", 0.2)):
        fit, test = records(app / "sweep" / job), records(app / "sweep" / job, "test")
        assert sorted(fit) == sorted(test) == [0, 1]
        held = [fit[rank]["params_held"] for rank in (0, 1)]
        assert sum(held) == fit[0]["params_total"] and max(held) < fit[0]["params_total"], held
        assert {seen["lr"] for seen in (*fit.values(), *test.values())} == {lr}
        assert {seen["pid"] for seen in fit.values()} == {seen["pid"] for seen in test.values()}
        assert fit[0]["weight_sum"] == fit[1]["weight_sum"] == test[0]["weight_sum"] == test[1]["weight_sum"]
        assert fit[0]["strategy"] == "hydra_fsdp.HydraModelParallel"
        last = app / "sweep" / job / "checkpoints" / "last.ckpt"
        assert last.is_dir() == distributed and last.exists()


def test_tensor_parallel_and_the_default_mesh_warning(app):
    # job 0: the default mesh (data_parallel=1 x tensor_parallel=2), warned of;
    # job 1: tensor_parallel_size=2 set
    ok(
        sweep(
            app, "+trainer.strategy.data_parallel_size=auto", "+trainer.strategy.tensor_parallel_size=auto,2"
        )
    )
    for job in ("0", "1"):
        fit = records(app / "sweep" / job)
        assert [fit[rank]["params_held"] for rank in (0, 1)] == [321, 321]  # each half, the last bias on both
        assert fit[0]["weight_sum"] == fit[1]["weight_sum"]
    warned = [(app / "sweep" / job / "rank_1.log").read_text() for job in ("0", "1")]
    assert "default mesh on one node is data_parallel=1 x tensor_parallel=2" in warned[0]
    assert "set data_parallel_size=2, tensor_parallel_size=1" in warned[0]
    assert "default mesh" not in warned[1]


def test_a_configure_model_that_shards_twice_fails_its_job_naming_the_fix(app):
    proc = sweep(app, "module.fail_how=configure_twice,none", *FSDP2, "stages=[fit,test]")
    assert proc.returncode != 0
    text = proc.text()
    assert "configure_model() sharded a module again" in text and "FSDPModule" in text, text[-6000:]
    assert sorted(records(app / "sweep" / "1", "test")) == [0, 1], "the next job ran"


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed checkpoint", "full checkpoint"])
def test_a_new_run_resumes_from_last_as_if_fit_had_never_stopped(tmp_path, distributed):
    # one epoch then a new sweep resuming from its last.ckpt to epoch 2, beside 2 epochs uninterrupted
    apps = [copy_app(tmp_path / name) for name in ("resumed", "uninterrupted")]
    common = (
        "module.lr=0.1",
        "module.seed=0",
        *FSDP2,
        f"+trainer.strategy.save_distributed_checkpoint={distributed}",
    )
    sweeps = [
        functools.partial(start_sweep, apps[0], *common, *CHECKPOINTED, strategy="model_parallel"),
        functools.partial(start_sweep, apps[1], *common, "trainer.max_epochs=2", strategy="model_parallel"),
    ]
    for run in run_side_by_side(sweeps, at_once=2):
        ok(run)
    last = apps[0] / "sweep" / "0" / "checkpoints" / "last.ckpt"
    resume = ("hydra.sweep.dir=resumed", "trainer.max_epochs=2", f"stages=[fit:same:{last}]")
    ok(sweep_in(apps[0], *common, *resume, strategy="model_parallel"))
    resumed, uninterrupted = records(apps[0] / "resumed" / "0"), records(apps[1] / "sweep" / "0")
    assert resumed[0]["weight_sum"] == resumed[1]["weight_sum"]
    assert resumed[0]["weight_sum"] == pytest.approx(uninterrupted[0]["weight_sum"], rel=1e-6)
    assert resumed[0]["weight_sum"] != pytest.approx(
        records(apps[0] / "sweep" / "0")[0]["weight_sum"], rel=1e-6
    )


def test_a_full_checkpoint_loads_across_hydra_ddp_and_hydra_model_parallel(tmp_path):
    # The same seed: both fits end with the same weights. Each strategy tests the other's last.ckpt,
    # then resumes fit from it to epoch 2 and ends where 2 uninterrupted epochs do; with momentum,
    # only if the optimizer's state crossed over too.
    apps = {strategy: copy_app(tmp_path / strategy) for strategy in ("ddp", "model_parallel")}
    uninterrupted = copy_app(tmp_path / "uninterrupted")
    sizes = {"ddp": (), "model_parallel": (*FSDP2, "+trainer.strategy.save_distributed_checkpoint=false")}
    common = ("module.seed=0", "module.momentum=0.9")
    last = {name: app / "sweep" / "0" / "checkpoints" / "last.ckpt" for name, app in apps.items()}
    fits = [
        functools.partial(start_sweep, app, *common, *sizes[name], *CHECKPOINTED, strategy=name)
        for name, app in apps.items()
    ]
    fits.append(functools.partial(start_sweep, uninterrupted, *common, "trainer.max_epochs=2"))
    tests = [
        functools.partial(
            start_sweep,
            app,
            "hydra.sweep.dir=other",
            *common,
            *sizes[name],
            "trainer.max_epochs=2",
            f"stages=[test:same:{last[other]},fit:fresh:{last[other]}]",
            strategy=name,
        )
        for (name, app), other in zip(apps.items(), ("model_parallel", "ddp"))
    ]
    for run in run_side_by_side(fits, at_once=2) + run_side_by_side(tests, at_once=2):
        ok(run)
    fitted = {name: records(app / "sweep" / "0")[0]["weight_sum"] for name, app in apps.items()}
    assert fitted["ddp"] == pytest.approx(fitted["model_parallel"], rel=1e-6)
    for name, app in apps.items():
        tested = records(app / "other" / "0", "test")
        assert tested[0]["weight_sum"] == tested[1]["weight_sum"] == pytest.approx(fitted["ddp"], rel=1e-6), (
            name
        )
    two_epochs = records(uninterrupted / "sweep" / "0")[0]["weight_sum"]
    for name, app in apps.items():
        resumed = records(app / "other" / "0")
        assert resumed[0]["weight_sum"] == resumed[1]["weight_sum"] == pytest.approx(two_epochs, rel=1e-6), (
            name
        )


def test_a_distributed_checkpoint_folder_consolidated_by_lightning_loads_into_hydra_ddp(tmp_path):
    # The folder (each rank its shard) is FSDP2's own layout; a user who evaluates with DDP, on one
    # GPU or outside a Trainer turns it into one file with Lightning's utility, run where the app is.
    app = copy_app(tmp_path)
    ok(sweep(app, "module.seed=0", *FSDP2, *CHECKPOINTED))
    folder = app / "sweep" / "0" / "checkpoints" / "last.ckpt"
    assert folder.is_dir(), "HydraModelParallel's default is a distributed-checkpoint folder"
    consolidate = [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint", str(folder)]
    ok(helpers.run(consolidate, app, app_env("ddp")))
    single_file = folder.with_name("last.ckpt.consolidated")
    ok(run_app(app, "hydra.sweep.dir=other", f"stages=[test:same:{single_file}]"))
    fitted = records(app / "sweep" / "0")[0]["weight_sum"]
    tested = records(app / "other" / "0", "test")
    assert tested[0]["weight_sum"] == tested[1]["weight_sum"] == pytest.approx(fitted, rel=1e-6)
    state_dict = torch.load(single_file, map_location="cpu", weights_only=False)["state_dict"]
    weight_sum = sum(float(tensor.double().sum()) for tensor in state_dict.values())
    assert weight_sum == pytest.approx(fitted, rel=1e-6), "torch.load of the consolidated file"


@pytest.mark.parametrize(
    "how, timeout, expect",
    [
        ("train_raise", (), ["Child rank 1 failed", "injected failure on rank 1"]),
        ("train_kill", (), ["Child rank 1 failed", "killed by SIGKILL"]),
        (
            "train_hang",
            ("trainer.strategy.timeout.seconds=5",),
            ["Timed out", "child ranks were still running"],
        ),
    ],
)
def test_a_failed_killed_or_hung_rank_fails_only_its_job(app, how, timeout, expect):
    proc = sweep(app, "module.lr=0.1,0.2", "module.fail_rank=1", f"module.fail_how={how}", *FSDP2, *timeout)
    assert_failed_job_then_healthy_job(app, proc, 1, expect_in_error=expect)


def test_sharded_trains_as_unsharded_the_same_weights_as_hydra_ddp(tmp_path):
    # the same initial weights on every rank (FSDP2, unlike DDP, broadcasts none), the same batches
    apps = [copy_app(tmp_path / strategy) for strategy in ("ddp", "model_parallel")]
    sweeps = [
        functools.partial(start_sweep, apps[0], "module.lr=0.1,0.2", "module.seed=0", strategy="ddp"),
        functools.partial(
            start_sweep, apps[1], "module.lr=0.1,0.2", "module.seed=0", *FSDP2, strategy="model_parallel"
        ),
    ]
    for run in run_side_by_side(sweeps, at_once=2):
        ok(run)
    for job in ("0", "1"):
        ddp, fsdp2 = (records(app / "sweep" / job)[0] for app in apps)
        assert fsdp2["params_held"] < ddp["params_held"] == ddp["params_total"]
        assert fsdp2["weight_sum"] == pytest.approx(ddp["weight_sum"], rel=1e-5), (job, ddp, fsdp2)
        print(
            f"job {job}: weight sum after fit, HydraDDP {ddp['weight_sum']!r}, FSDP2 {fsdp2['weight_sum']!r}"
        )


def test_under_torchrun_it_starts_no_process_and_shards_over_the_engines_ranks(app):
    codes, output, _ = torchrun(
        app, "module.lr=0.1,0.2", "module.stamp=same", *FSDP2, strategy="model_parallel"
    )
    assert codes == [0], output[-6000:]
    for job in ("0", "1"):
        seen = assert_ranks_agree(app / "sweep" / job)
        assert not (app / "sweep" / job / "rank_1.log").exists(), "under torchrun it starts no process"
        assert seen[0]["params_held"] + seen[1]["params_held"] == seen[0]["params_total"]


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs"
)
def test_two_gpu_nccl_sweep_and_a_failed_rank(app):
    # FSDP2 over NCCL: fit then test(best) from a distributed checkpoint; in job 0 rank 1 raises mid-fit,
    # rank 0's collective is aborted (not left to NCCL's timeout), and job 1 trains
    proc = sweep(
        app,
        "module.lr=0.1,0.2",
        "trainer.accelerator=gpu",
        *FSDP2,
        *CHECKPOINTED,
        "stages=[fit,test:same:best]",
        "module.fail_rank=1",
        "module.fail_how=train_raise",
    )
    assert_failed_job_then_healthy_job(
        app, proc, 1, expect_in_error=["Child rank 1 failed", "injected failure"]
    )
    seen = assert_ranks_agree(app / "sweep" / "1", "test")
    assert (
        sum(rank["params_held"] for rank in records(app / "sweep" / "1").values()) == seen[0]["params_total"]
    )
