"""HydraModelParallel (Lightning's ModelParallelStrategy: FSDP2, tensor parallelism) in real sweeps of
2 CPU ranks a job: what each rank held, its checkpoints, and the mistakes it names.

Three sweeps of cases (see shared.py) serve the tests: the fits (each scenario a job, with HydraDDP
jobs from the same initial weights to compare each rank's part with), the loads of the fits'
checkpoints (a second sweep: it needs their paths), and the failing jobs, each followed by a healthy
one, started as the module starts (it spends its time waiting on failures)."""

import sys

import helpers
import pytest
import torch
from helpers import (
    MODEL_PARALLEL,
    MODEL_PARALLEL_REASON,
    RECORD_ALIVE,
    app_env,
    assert_failed_job_then_healthy_job,
    assert_ranks_agree,
    copy_app,
    ok,
    records,
    start_sweep,
    sweep_in,
    wait_all,
)
from shared import case_overrides, nothing_outlives
from test_external import torchrun

pytestmark = pytest.mark.skipif(
    not MODEL_PARALLEL,
    reason=MODEL_PARALLEL_REASON,
)
FSDP2 = ("+trainer.strategy.data_parallel_size=2", "+trainer.strategy.tensor_parallel_size=1")
CHECKPOINTED = {"trainer.enable_checkpointing": True, "trainer.callbacks": ["${keep_last}"]}
# two epochs, the first one "best" (the highest val_loss): loading best is told apart from loading last
BEST_IS_FIRST = {
    "trainer.enable_checkpointing": True,
    "trainer.callbacks": ["${best_is_first}", "${keep_last}"],
    "trainer.max_epochs": 2,
}
SEED = {"module.seed": 0}  # the same initial weights, whichever strategy (and how many ranks) holds them
LRS = (0.05, 0.1)  # at 0.2 the second epoch's val_loss is higher: its best would be the last
# A case can neither add keys to trainer.strategy's typed node nor replace it: the sweep puts
# strategies.<strategies.use> (the app's) in its place, and a case sets that one's arguments.
CASE_STRATEGY = "trainer.strategy='${strategies.${strategies.use}}'"
DDP = {"strategies.use": "ddp", "module._target_": "__main__.Tiny"}


def mesh(data_parallel, tensor_parallel, distributed=True):
    return {
        "strategies.model_parallel.data_parallel_size": data_parallel,
        "strategies.model_parallel.tensor_parallel_size": tensor_parallel,
        "strategies.model_parallel.save_distributed_checkpoint": distributed,
    }


KINDS = {"distributed": True, "full": False}  # save_distributed_checkpoint
FITS = {
    # SGD without momentum: a full checkpoint of it is one Lightning alone cannot load (IndexError)
    **{
        f"shards_{kind}_{lr}": {
            "module.lr": lr,
            **SEED,
            **mesh(2, 1, distributed),
            **BEST_IS_FIRST,
            "stages": ["fit", "test:same:best", "fit:fresh:last"],
        }
        for kind, distributed in KINDS.items()
        for lr in LRS
    },
    # what the shards' ranks should hold: HydraDDP from the same start, on the same batches
    **{f"ddp_{lr}": {**DDP, "module.lr": lr, **SEED, "trainer.max_epochs": 2} for lr in LRS},
    # the default mesh (data_parallel=1 x tensor_parallel=2), warned of; tensor_parallel_size=2 set;
    # every rank sees every batch: they train as one device does
    "tp_default": {**SEED, **mesh("auto", "auto")},
    "tp_2": {**SEED, **mesh("auto", 2)},
    "one_device": {**DDP, **SEED, "trainer.devices": 1},
    # a full checkpoint of each strategy with momentum (the optimizer has state) at epoch 0 (best), and
    # where 2 uninterrupted epochs end
    "uninterrupted": {"module.lr": 0.1, **SEED, **mesh(2, 1), "trainer.max_epochs": 2},
    "momentum_ddp": {**DDP, **SEED, "module.momentum": 0.9, **BEST_IS_FIRST},
    "momentum_model_parallel": {**SEED, "module.momentum": 0.9, **mesh(2, 1, False), **BEST_IS_FIRST},
}


def epoch0_checkpoint(job):
    """The checkpoint best_is_first kept of epoch 0."""
    found = list((job / "checkpoints").glob("best-epoch=0*.ckpt"))
    kept = sorted(path.name for path in (job / "checkpoints").iterdir())
    assert len(found) == 1, (
        f"{job.name} kept {kept}, not epoch 0 as best: was the first epoch's val_loss the highest?"
    )
    return found[0]


def run_cases(app, cases, *overrides):
    with nothing_outlives(f"the sweep in {app}"):
        run = start_sweep(app, *case_overrides(app / "conf", cases), *overrides, strategy="model_parallel")
        wait_all([run])
    return {case: app / "sweep" / case for case in cases}, ok(run)


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """The sweep of FITS: {case: job dir}, and its run."""
    return run_cases(copy_app(tmp_path_factory.mktemp("fits")), FITS, CASE_STRATEGY)


# One sweep of the jobs that fail, each followed by a healthy one ("<case>_next", with the same
# timeouts), FSDP2 in all; the app's RecordError writes each failed job's error to its error.txt (at
# its end Hydra prints the first one's alone). Last, a healthy job whose checkpoint is of
# HydraModelParallel's default kind.
GROUP_TIMEOUT = {"trainer.strategy.timeout.seconds": 5}  # the process group's
FAILING = {
    "configure_twice": {"module.fail_how": "configure_twice", "stages": ["fit", "test"]},
    "train_raise": {"module.fail_rank": 1, "module.fail_how": "train_raise"},
    "train_kill": {"module.fail_rank": 1, "module.fail_how": "train_kill"},
    "train_hang": {"module.fail_rank": 1, "module.fail_how": "train_hang", **GROUP_TIMEOUT},
}
FIRST = next(iter(FAILING))


@pytest.fixture(scope="module", autouse=True)
def failing_sweep_started(tmp_path_factory):
    """The sweep of every FAILING case, each followed by its healthy one, started as the module starts;
    its app dir and Run."""
    app = copy_app(tmp_path_factory.mktemp("failing"))
    cases = {}
    for case, settings in FAILING.items():
        cases[case] = {**settings, "module.fail_job": "${hydra:job.num}"}  # fails in its own job
        cases[f"{case}_next"] = {
            "module.lr": 0.2,
            **{key: value for key, value in settings.items() if key.startswith(("trainer.", "stages"))},
        }
    cases["default_checkpoint"] = {**SEED, **CHECKPOINTED}
    record_errors = "+hydra.callbacks.record_error._target_=__main__.RecordError"
    with nothing_outlives("the failing sweep"):
        sweep = start_sweep(
            app,
            *case_overrides(app / "conf", cases),
            *FSDP2,
            record_errors,
            RECORD_ALIVE,
            strategy="model_parallel",
        )
        yield app, sweep
        sweep.end()  # where no test waited for it


@pytest.fixture(scope="module")
def failing_sweep(failing_sweep_started):
    """The failing sweep's app dir and run, once it ended."""
    app, sweep = failing_sweep_started
    wait_all([sweep])
    return app, sweep


def error_of(failing_sweep, case):
    """Job ``case``'s error; for the sweep's first failed job, the sweep's output too (Hydra printed it)."""
    app, proc = failing_sweep
    error = (app / "sweep" / case / "error.txt").read_text()
    return error + proc.text() if case == FIRST else error


@pytest.fixture(scope="module")
def loads(fits, failing_sweep, tmp_path_factory):
    """The sweep that loads the fits' checkpoints (and the default one, consolidated by Lightning's
    utility into one file, as a user who evaluates with DDP does): {case: job dir}."""
    jobs, _ = fits
    folder = failing_sweep[0] / "sweep" / "default_checkpoint" / "checkpoints" / "last.ckpt"
    if folder.is_dir():  # else the test of it fails, naming it
        consolidate = [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint", str(folder)]
        ok(helpers.run(consolidate, failing_sweep[0], app_env("ddp")))
    cross = {"ddp": "momentum_model_parallel", "model_parallel": "momentum_ddp"}  # each loads the other's
    cases = {
        # a new run resuming from a checkpoint of epoch 0 to epoch 2
        **{
            f"resumed_{kind}": {
                "module.lr": 0.1,
                **SEED,
                **mesh(2, 1, distributed),
                "trainer.max_epochs": 2,
                "stages": [f"fit:same:{epoch0_checkpoint(jobs[f'shards_{kind}_0.1'])}"],
            }
            for kind, distributed in KINDS.items()
        },
        # each strategy tests the other's full checkpoint, then resumes fit from it to epoch 2
        **{
            f"{name}_loads": {
                **(DDP if name == "ddp" else mesh(2, 1, False)),
                **SEED,
                "module.momentum": 0.9,
                "trainer.max_epochs": 2,
                "stages": [
                    f"test:same:{epoch0_checkpoint(jobs[other])}",
                    f"fit:fresh:{epoch0_checkpoint(jobs[other])}",
                ],
            }
            for name, other in cross.items()
        },
        "consolidated": {**DDP, "stages": [f"test:same:{folder.with_name('last.ckpt.consolidated')}"]},
    }
    return run_cases(copy_app(tmp_path_factory.mktemp("loads")), cases, CASE_STRATEGY)[0]


def local_sums(seen):
    """What each rank held: the sum of its own part of the weights (its shard, or its whole copy)."""
    return [seen[rank]["local_weight_sum"] for rank in sorted(seen)]


def close(held, expected, rel=1e-5):
    return held == pytest.approx(expected, rel=rel, abs=1e-4)


@pytest.mark.parametrize("kind", KINDS, ids=["distributed checkpoint", "full checkpoint"])
def test_each_rank_holds_its_shard_and_fit_test_best_resume_last_run_on_one_set_of_ranks(fits, kind):
    jobs, proc = fits
    assert proc.text().count(f"Launching {len(jobs)} jobs locally") == 1, (
        "the sweep ran once, not once a rank"
    )
    for lr in LRS:
        job = jobs[f"shards_{kind}_{lr}"]
        fit, test = records(job), records(job, "test")
        epochs = [records(job, f"epoch{n}") for n in (0, 1)]
        assert sorted(fit) == sorted(test) == sorted(epochs[0]) == sorted(epochs[1]) == [0, 1]
        held = [fit[rank]["params_held"] for rank in (0, 1)]
        assert sum(held) == fit[0]["params_total"] and max(held) < fit[0]["params_total"], held
        assert {seen["lr"] for seen in (*fit.values(), *test.values())} == {lr}
        assert {seen["pid"] for seen in fit.values()} == {seen["pid"] for seen in test.values()}
        assert {seen["pid"] for seen in fit.values()} == {seen["pid"] for seen in epochs[0].values()}
        assert fit[0]["weight_sum"] == fit[1]["weight_sum"] and test[0]["weight_sum"] == test[1]["weight_sum"]
        assert fit[0]["strategy"] == "hydra_fsdp.HydraModelParallel"
        # test(best) loaded epoch 0's checkpoint on every rank: not the final weights (what loading
        # nothing, or last.ckpt, leaves in this same module)
        epoch0_checkpoint(job)  # best_is_first kept epoch 0's
        assert close(local_sums(test), local_sums(epochs[0]), rel=1e-6), (
            local_sums(test),
            local_sums(epochs[0]),
        )
        for rank in (0, 1):
            assert not close(test[rank]["local_weight_sum"], epochs[1][rank]["local_weight_sum"], rel=1e-6), (
                f"rank {rank} tested the last weights, not the best"
            )
        # each rank holds its rows (FSDP2 shards each parameter along dim 0) of the weights HydraDDP
        # trains from the same start on the same batches, at each epoch's end
        for n, held_then in enumerate(epochs):
            rows = records(jobs[f"ddp_{lr}"], f"epoch{n}")[0]["shards_should_hold"]["rows"]
            assert close(local_sums(held_then), rows), (job.name, f"epoch {n}", local_sums(held_then), rows)
        # fit(fresh module, last.ckpt of epoch 1) had no epoch left to train: it ends where the fit did
        assert close(local_sums(fit), local_sums(epochs[1]), rel=1e-6), (
            local_sums(fit),
            local_sums(epochs[1]),
        )
        last = job / "checkpoints" / "last.ckpt"
        assert last.is_dir() == KINDS[kind] and last.exists()


def test_tensor_parallel_and_the_default_mesh_warning(fits):
    jobs, _ = fits
    # what each of 2 tensor-parallel ranks should hold of the weights one device trains on every batch
    expected = records(jobs["one_device"])[0]["tensor_parallel_should_hold"]
    for case in ("tp_default", "tp_2"):
        fit = records(jobs[case])
        assert [fit[rank]["params_held"] for rank in (0, 1)] == [321, 321]  # each half, the last bias on both
        assert fit[0]["weight_sum"] == fit[1]["weight_sum"]
        assert close(local_sums(fit), expected), (case, local_sums(fit), expected)
    warned = [(jobs[case] / "rank_1.log").read_text() for case in ("tp_default", "tp_2")]
    assert "default mesh on one node is data_parallel=1 x tensor_parallel=2" in warned[0]
    assert "set data_parallel_size=2, tensor_parallel_size=1" in warned[0]
    assert "default mesh" not in warned[1]


@pytest.mark.parametrize("kind", KINDS, ids=["distributed checkpoint", "full checkpoint"])
def test_a_new_run_resumes_from_last_as_if_fit_had_never_stopped(fits, loads, kind):
    # one epoch's checkpoint, then a new sweep resuming from it to epoch 2, beside 2 epochs uninterrupted
    fitted = fits[0][f"shards_{kind}_0.1"]
    resumed, one_epoch, uninterrupted = (
        records(loads[f"resumed_{kind}"]),
        records(fitted, "epoch0"),
        records(fits[0]["uninterrupted"]),
    )
    assert resumed[0]["weight_sum"] == resumed[1]["weight_sum"]
    assert resumed[0]["weight_sum"] == pytest.approx(uninterrupted[0]["weight_sum"], rel=1e-6)
    assert resumed[0]["weight_sum"] != pytest.approx(one_epoch[0]["weight_sum"], rel=1e-6)
    # each rank ends with its own shard of where 2 uninterrupted epochs end
    assert close(local_sums(resumed), local_sums(uninterrupted), rel=1e-6), (
        local_sums(resumed),
        local_sums(uninterrupted),
    )
    for rank in (0, 1):
        assert not close(resumed[rank]["local_weight_sum"], one_epoch[rank]["local_weight_sum"], rel=1e-6)


def test_a_full_checkpoint_loads_across_hydra_ddp_and_hydra_model_parallel(fits, loads):
    # The same seed: both fits end epoch 0 with the same weights. Each strategy tests the other's
    # checkpoint, then resumes fit from it to epoch 2 and ends where 2 uninterrupted epochs do; with
    # momentum, only if the optimizer's state crossed over too.
    jobs, _ = fits
    ddp = [records(jobs["momentum_ddp"], f"epoch{n}")[0] for n in (0, 1)]
    fitted = {name: records(jobs[f"momentum_{name}"], "epoch0") for name in ("ddp", "model_parallel")}
    assert fitted["ddp"][0]["weight_sum"] == pytest.approx(
        fitted["model_parallel"][0]["weight_sum"], rel=1e-6
    )
    rows = ddp[0]["shards_should_hold"]["rows"]
    assert close(local_sums(fitted["model_parallel"]), rows), (local_sums(fitted["model_parallel"]), rows)
    # what each rank should hold after loading epoch 0, and after 2 epochs: its rows, or its whole copy
    should = {
        "ddp": [[seen["local_weight_sum"]] * 2 for seen in ddp],
        "model_parallel": [seen["shards_should_hold"]["rows"] for seen in ddp],
    }
    for name in ("ddp", "model_parallel"):
        tested = records(loads[f"{name}_loads"], "test")
        assert (
            tested[0]["weight_sum"]
            == tested[1]["weight_sum"]
            == pytest.approx(ddp[0]["weight_sum"], rel=1e-6)
        ), name
        assert close(local_sums(tested), should[name][0], rel=1e-6), (
            name,
            local_sums(tested),
            should[name][0],
        )
    two_epochs = ddp[1]["weight_sum"]
    for name in ("ddp", "model_parallel"):
        resumed = records(loads[f"{name}_loads"])
        assert resumed[0]["weight_sum"] == resumed[1]["weight_sum"] == pytest.approx(two_epochs, rel=1e-6), (
            name
        )
        assert close(local_sums(resumed), should[name][1], rel=1e-6), (
            name,
            local_sums(resumed),
            should[name][1],
        )


def test_a_distributed_checkpoint_folder_consolidated_by_lightning_loads_into_hydra_ddp(failing_sweep, loads):
    # The folder (each rank its shard) is FSDP2's own layout; a user who evaluates with DDP, on one
    # GPU or outside a Trainer turns it into one file with Lightning's utility, run where the app is.
    job = failing_sweep[0] / "sweep" / "default_checkpoint"
    folder = job / "checkpoints" / "last.ckpt"
    assert folder.is_dir(), "HydraModelParallel's default is a distributed-checkpoint folder"
    single_file = folder.with_name("last.ckpt.consolidated")
    fitted = records(job)[0]["weight_sum"]
    tested = records(loads["consolidated"], "test")
    assert tested[0]["weight_sum"] == tested[1]["weight_sum"] == pytest.approx(fitted, rel=1e-6)
    assert close(local_sums(tested), [fitted, fitted], rel=1e-6), "each DDP rank loaded the whole of it"
    state_dict = torch.load(single_file, map_location="cpu", weights_only=False)["state_dict"]
    weight_sum = sum(float(tensor.double().sum()) for tensor in state_dict.values())
    assert weight_sum == pytest.approx(fitted, rel=1e-6), "torch.load of the consolidated file"


def test_sharded_trains_as_unsharded_the_same_weights_as_hydra_ddp(fits):
    # the same initial weights on every rank (FSDP2, unlike DDP, broadcasts none), the same batches
    jobs, _ = fits
    for lr in LRS:
        for epoch in ("epoch0", "epoch1"):
            ddp, fsdp2 = (records(jobs[case], epoch)[0] for case in (f"ddp_{lr}", f"shards_distributed_{lr}"))
            assert fsdp2["params_held"] < ddp["params_held"] == ddp["params_total"]
            assert fsdp2["weight_sum"] == pytest.approx(ddp["weight_sum"], rel=1e-5), (lr, epoch, ddp, fsdp2)
        print(f"lr {lr}: weight sum after fit, HydraDDP {ddp['weight_sum']!r}, FSDP2 {fsdp2['weight_sum']!r}")


def test_under_torchrun_it_starts_no_process_and_shards_over_the_engines_ranks(app, fits):
    codes, output, _ = torchrun(
        app,
        f"module.lr={LRS[0]},{LRS[1]}",
        "module.stamp=same",
        "module.seed=0",
        *FSDP2,
        strategy="model_parallel",
    )
    assert codes == [0], output[-6000:]
    for job, lr in (("0", LRS[0]), ("1", LRS[1])):
        seen = assert_ranks_agree(app / "sweep" / job)
        assert not (app / "sweep" / job / "rank_1.log").exists(), "under torchrun it starts no process"
        assert seen[0]["params_held"] + seen[1]["params_held"] == seen[0]["params_total"]
        # each of the engine's ranks holds its rows of what HydraDDP trains in one epoch
        rows = records(fits[0][f"ddp_{lr}"], "epoch0")[0]["shards_should_hold"]["rows"]
        assert close(local_sums(seen), rows), (job, local_sums(seen), rows)


def test_a_configure_model_that_shards_twice_fails_its_job_naming_the_fix(failing_sweep):
    app, proc = failing_sweep
    assert proc.returncode != 0
    text = error_of(failing_sweep, "configure_twice")
    assert "configure_model() sharded a module again" in text and "FSDPModule" in text, text[-6000:]
    assert sorted(records(app / "sweep" / "configure_twice_next", "test")) == [0, 1], "the next job ran"


@pytest.mark.parametrize(
    "how, expect",
    [
        ("train_raise", ["Child rank 1 failed", "injected failure on rank 1"]),
        ("train_kill", ["Child rank 1 failed", "killed by SIGKILL"]),
        ("train_hang", ["Timed out", "child ranks were still running"]),
    ],
)
def test_a_failed_killed_or_hung_rank_fails_only_its_job(failing_sweep, how, expect):
    app, proc = failing_sweep
    assert_failed_job_then_healthy_job(
        app,
        proc,
        1,
        expect_in_error=expect,
        failed=how,
        healthy=f"{how}_next",
        error=error_of(failing_sweep, how),
        first_of_sweep=how == FIRST,
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs"
)
def test_two_gpu_nccl_sweep_and_a_failed_rank(app):
    # FSDP2 over NCCL: fit then test(best) from a distributed checkpoint; in job 0 rank 1 raises mid-fit,
    # rank 0's collective is aborted (not left to NCCL's timeout), and job 1 trains
    proc = sweep_in(
        app,
        "module.lr=0.1,0.2",
        "trainer.accelerator=gpu",
        *FSDP2,
        "trainer.enable_checkpointing=true",
        "trainer.callbacks=[${keep_last}]",
        "stages=[fit,test:same:best]",
        "module.fail_rank=1",
        "module.fail_how=train_raise",
        RECORD_ALIVE,
        strategy="model_parallel",
    )
    assert_failed_job_then_healthy_job(
        app, proc, 1, expect_in_error=["Child rank 1 failed", "injected failure"]
    )
    seen = assert_ranks_agree(app / "sweep" / "1", "test")
    assert (
        sum(rank["params_held"] for rank in records(app / "sweep" / "1").values()) == seen[0]["params_total"]
    )


def saved_on(path):
    """The devices a checkpoint file's tensors were saved from ("cpu", "cuda:1"...)."""
    found = set()
    torch.load(
        path, map_location=lambda storage, location: found.add(location) or storage, weights_only=False
    )
    return found


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs"
)
def test_a_full_checkpoint_saved_on_cuda_1_loads_where_one_gpu_is_visible(app):
    """HydraDDP on cuda:1 alone saves a full checkpoint of tensors on cuda:1; HydraModelParallel reads it
    to the CPU, as Lightning does, and tests it with one GPU visible. (Read without map_location it
    could not: "Attempting to deserialize object on CUDA device 1 but torch.cuda.device_count() is 1".)"""
    one_gpu = ("trainer.accelerator=gpu", "trainer.devices=1")
    saving = (*one_gpu, "trainer.enable_checkpointing=true", "trainer.callbacks=[${keep_last}]")
    ok(helpers.run_app(app, "hydra.sweep.dir=saved", *saving, env={"HYDRA_FSDP_GPUS": "1"}))
    last = app / "saved" / "0" / "checkpoints" / "last.ckpt"
    assert "cuda:1" in saved_on(last)
    mesh_of_one = ("+trainer.strategy.data_parallel_size=1", "+trainer.strategy.tensor_parallel_size=1")
    testing = (*one_gpu, *mesh_of_one, f"stages=['test:same:{last}']")
    ok(sweep_in(app, *testing, strategy="model_parallel", env={"CUDA_VISIBLE_DEVICES": "0"}))
    assert records(app / "sweep" / "0", "test")[0]["strategy"].endswith("HydraModelParallel")
