"""The app users really write: lightning-hydra-template's train.py (tests/apps/template), swept.

Callbacks and loggers come from their own config groups and reach the Trainer as
``instantiate(cfg.trainer, callbacks=callbacks, logger=logger)``; the task function is wrapped in
the template's ``task_wrapper``, seeds from ``cfg.seed``, fits with ``ckpt_path=cfg.get("ckpt_path")``
and tests with ``ckpt_path=trainer.checkpoint_callback.best_model_path``. Every rank must build
and run all of it, as rank 0 does.
"""

import csv
import sys
from pathlib import Path

import pytest
from helpers import (
    MODEL_PARALLEL,
    MODEL_PARALLEL_REASON,
    SWEPT,
    SWEPT_JOBS,
    SWEPT_LR_VALUES,
    SWEPT_LRS,
    app_env,
    copy_template,
    ok,
    records,
    run,
    swept_jobs,
)
from shared import nothing_outlives
from test_readme import blocks

CALLBACKS = ["EarlyStopping", "ModelCheckpoint", "ModelSummary"]


# The README's YAML trainer config, pasted into the template as configs/trainer/readme.yaml: its jobs
# follow those of the trainer configs named as the strategies.
README_JOBS = list(enumerate(SWEPT_LRS, start=SWEPT_JOBS))
# then configs/trainer/model_parallel.yaml's (HydraModelParallel, FSDP2), where Lightning and torch have it
MODEL_PARALLEL_JOBS = (
    list(enumerate(SWEPT_LRS, start=SWEPT_JOBS + len(README_JOBS))) if MODEL_PARALLEL else []
)


@pytest.fixture(scope="module")
def template_sweep(tmp_path_factory):
    """The template project, swept once over every trainer config (named as the strategies, and the
    README's) and lr; and its run."""
    template = copy_template(tmp_path_factory.mktemp("template") / "project")
    (template / "configs" / "trainer" / "readme.yaml").write_text(blocks("yaml")[0])
    command = [sys.executable, "src/train.py", "-m", "hydra.sweep.dir=sweep"]
    trainers = [*SWEPT, "readme"] + ["model_parallel"] * MODEL_PARALLEL
    overrides = [f"trainer={','.join(trainers)}", f"model.lr={SWEPT_LR_VALUES}"]
    with nothing_outlives("the template's sweep"):
        proc = run(command + overrides, template, app_env())
    return template, proc


def assert_ranks_hold_their_part(template, job_dir, lr, layout):
    """Each rank of a sharded job (``layout``: "flat", HydraFSDP's; "rows", FSDP2's) holds, after fit and
    at test, its part of the weights the DDP job of the same lr holds then (the same seed, the same
    batches): each rank's own sum (local_weight_sum), not one reduced over the ranks."""
    ddp_job = template / "sweep" / str({value: job for job, value in swept_jobs("ddp")}[lr])
    for stage in ("fit", "test"):
        seen, ddp = records(job_dir, stage), records(ddp_job, stage)[0]
        if stage == "test":  # the same best checkpoint, by epoch
            assert Path(seen[0]["ckpt_path"]).name == Path(ddp["ckpt_path"]).name, (seen[0], ddp)
        should_hold = ddp["shards_should_hold"][layout]
        for rank in (0, 1):
            assert seen[rank]["local_weight_sum"] == pytest.approx(should_hold[rank], rel=1e-5, abs=1e-4), (
                stage,
                rank,
                should_hold,
            )


@pytest.mark.parametrize("trainer", ["ddp", "fsdp"])
def test_template_train_py_sweep(template_sweep, trainer):
    template, proc = template_sweep
    ok(proc)
    strategy = f"hydra_fsdp.lightning.Hydra{trainer.upper()}"
    for job, lr in swept_jobs(trainer):
        job_dir = template / "sweep" / str(job)
        fit, tested = records(job_dir, "fit"), records(job_dir, "test")
        assert sorted(fit) == sorted(tested) == [0, 1]
        for seen in (*fit.values(), *tested.values()):
            assert seen["lr"] == lr and seen["world"] == 2 and seen["strategy"] == strategy
            assert seen["callbacks"] == CALLBACKS and seen["loggers"] == ["CSVLogger"]
            assert seen["output_dir"] == str(job_dir)
        for rank in (0, 1):
            assert fit[rank]["pid"] == tested[rank]["pid"], "one process per rank for the whole job"
        assert fit[0]["pid"] != fit[1]["pid"]
        # the same weights on every rank, after fit and at test (those of the best checkpoint)
        assert fit[0]["weight_sum"] == fit[1]["weight_sum"]
        assert tested[0]["weight_sum"] == tested[1]["weight_sum"]
        if trainer == "fsdp":
            assert fit[0]["params_held"] + fit[1]["params_held"] == 321
            assert_ranks_hold_their_part(template, job_dir, lr, "flat")
        else:  # each rank its own full copy
            for seen in (*fit.values(), *tested.values()):
                assert seen["params_held"] == 321 and seen["local_weight_sum"] == seen["weight_sum"]
        # each job has its own checkpoints, and tested the best one on every rank
        checkpoints = sorted(p.name for p in (job_dir / "checkpoints").iterdir())
        assert "last.ckpt" in checkpoints and any(name.startswith("epoch_") for name in checkpoints)
        best = tested[0]["ckpt_path"]
        assert best == tested[1]["ckpt_path"] and Path(best).parent == job_dir / "checkpoints"
        assert Path(best).name.startswith("epoch_")
        # and its logged test metrics, written once (by rank 0)
        rows = list(csv.DictReader((job_dir / "csv" / "version_0" / "metrics.csv").open()))
        assert [row["test/loss"] for row in rows if row.get("test/loss")], rows
        assert not (job_dir / "csv" / "version_1").exists()
    print(
        f"template train.py, {SWEPT_JOBS + len(README_JOBS) + len(MODEL_PARALLEL_JOBS)} jobs x 2 ranks:"
        f" {proc.seconds:.1f} s"
    )


@pytest.mark.skipif(not MODEL_PARALLEL, reason=MODEL_PARALLEL_REASON)
def test_template_train_py_sweep_with_model_parallel(template_sweep):
    template, proc = template_sweep
    ok(proc)
    for job, lr in MODEL_PARALLEL_JOBS:
        job_dir = template / "sweep" / str(job)
        fit, tested = records(job_dir, "fit"), records(job_dir, "test")
        assert sorted(fit) == sorted(tested) == [0, 1]
        for seen in (*fit.values(), *tested.values()):
            assert seen["lr"] == lr and seen["strategy"] == "hydra_fsdp.lightning.HydraModelParallel"
            assert seen["callbacks"] == CALLBACKS and seen["loggers"] == ["CSVLogger"]
        assert fit[0]["params_held"] + fit[1]["params_held"] == 321 and fit[0]["params_held"] < 321
        assert (
            fit[0]["weight_sum"] == fit[1]["weight_sum"]
            and tested[0]["weight_sum"] == tested[1]["weight_sum"]
        )
        assert_ranks_hold_their_part(template, job_dir, lr, "rows")
        best = tested[0]["ckpt_path"]
        assert best == tested[1]["ckpt_path"] and Path(best).is_dir(), "a distributed checkpoint, tested"


def test_readme_yaml_trainer_config_in_the_template(template_sweep):
    template, proc = template_sweep
    ok(proc)
    for job, lr in README_JOBS:
        for stage in ("fit", "test"):
            seen = records(template / "sweep" / str(job), stage)
            assert sorted(seen) == [0, 1] and {rank["lr"] for rank in seen.values()} == {lr}
            assert {rank["strategy"] for rank in seen.values()} == {"hydra_fsdp.lightning.HydraDDP"}
