"""HydraModelParallel (Lightning's ModelParallelStrategy: FSDP2, tensor parallelism) in real sweeps of
2 jobs x 2 CPU ranks: what each rank held, its checkpoints, and the mistakes it names."""

import pytest
from helpers import MODEL_PARALLEL, assert_failed_job_then_healthy_job, ok, records, sweep_in

pytestmark = pytest.mark.skipif(
    not MODEL_PARALLEL,
    reason="Lightning or torch < 2.4: no ModelParallelStrategy (the refusal is a unit test)",
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
    # job 0: the default mesh (data_parallel=1 x tensor_parallel=2), warned of; job 1: tensor_parallel_size=2 set
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


def test_a_failed_rank_fails_only_its_job(app):
    proc = sweep(app, "module.lr=0.1,0.2", "module.fail_rank=1", "module.fail_how=train_raise", *FSDP2)
    assert_failed_job_then_healthy_job(
        app, proc, 1, expect_in_error=["Child rank 1 failed", "injected failure"]
    )
