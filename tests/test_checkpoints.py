"""Every checkpoint HydraFSDP writes loads, in every way users load one (issue 17).

The app is the lightning-hydra-template-shaped one (tests/apps/template): ``model=net`` is the
template's own trait, a ``net`` nn.Module built by the config and kept in the hyperparameters by
``save_hyperparameters(logger=False)``, which pickles the module into every checkpoint;
``model=tiny`` keeps only numbers there. One sweep writes a checkpoint of each (DDP, FSDP full,
FSDP sharded) x (net, tiny); the tests load them by resuming, by testing in a new run (the
template's eval.py) on 1, 2 and 3 ranks, across strategies, and outside any Trainer. Each rank
records the sum of the weights it holds (gathered, for FSDP) at the stage, which must be the sum
of the checkpoint it loaded.

Loading a pickled nn.Module is refused by torch's default ``weights_only=True`` (torch >= 2.6),
under DDP as under FSDP: the runs that load one set ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, the
user's own way to allow it, and one test checks the refusal.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import APPS, Run, app_env, ok, records, run, wait_all
from shared import case_overrides, nothing_outlives

pytestmark = pytest.mark.fsdp_cpu  # every test loads what HydraFSDP wrote on the CPU

TRUSTED = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
KEEP_ALL = "+callbacks.model_checkpoint.save_top_k=-1"  # epoch_000 differs from last: a load shows
JOBS = {  # the writing sweep's jobs, in Hydra's order
    (trainer, model): job
    for job, (trainer, model) in enumerate(
        (trainer, model)
        for trainer in ("ddp", "fsdp", "fsdp_sharded", "fsdp_wrapped")
        for model in ("net", "tiny")
    )
}


READ = """
import json, runpy, sys, torch
sys.path.insert(0, ".")  # the checkpoint pickles the app's own classes
sharded, files = json.loads(sys.argv[1])
for directory in sharded:  # what `python -m lightning.pytorch.utilities.consolidate_checkpoint DIR` runs
    sys.argv[1:] = [directory]
    runpy.run_module("lightning.pytorch.utilities.consolidate_checkpoint", run_name="__main__")
sums = {}
for path in files:
    state_dict = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    sums[path] = sum(float(tensor.double().sum()) for tensor in state_dict.values())
print(json.dumps(sums))
"""
SUMS = {}  # checkpoint path: the sum of its weights


def checkpoint_sums(paths):
    """The sum of each checkpoint's weights, by path; a sharded one is read through its consolidated
    file, which Lightning's own utility writes. One process, run from the project's root (it imports
    the app's classes the checkpoint pickles), consolidates and reads all those not read yet: each
    process started imports torch and Lightning, seconds of CPU."""
    paths = [Path(path) for path in paths]
    files = {
        str(path): path.with_name(path.name + ".consolidated") if path.is_dir() else path for path in paths
    }
    sharded = sorted(str(path) for path in paths if path.is_dir() and not files[str(path)].exists())
    unread = sorted({str(file) for file in files.values()} - set(SUMS))
    if unread:
        proc = subprocess.run([sys.executable, "-c", READ, json.dumps([sharded, unread])],
                              cwd=project_of(unread[0]), env=app_env(env=TRUSTED), capture_output=True,
                              text=True, timeout=120, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-5000:]
        SUMS.update(json.loads(proc.stdout.splitlines()[-1]))
    return {path: SUMS[str(file)] for path, file in files.items()}


def checkpoint_sum(path):
    return checkpoint_sums([path])[str(path)]


def consolidated(directory):
    """The file Lightning's utility made of the sharded checkpoint ``directory`` (see checkpoint_sums)."""
    checkpoint_sums([directory])
    return directory.with_name(directory.name + ".consolidated")


def project_of(path):
    return next(parent for parent in Path(path).parents if (parent / ".project-root").exists())


def script(project, name, *overrides, env=TRUSTED, multirun=False):
    command = [sys.executable, f"src/{name}.py"] + (["-m"] if multirun else []) + list(overrides)
    return run(command, project, app_env(env=env))


def scripts_at_once(project, runs):
    """Start runs that do not depend on each other side by side ({name: (script, overrides, env)}),
    each in a session of its own; wait for every one. Returns {name: its Run}: each its own output
    and exit code. A run that outlives SWEEP_TIMEOUT fails the test, and every run is ended."""
    started = {
        name: Run([sys.executable, f"src/{script_name}.py", *overrides], project, app_env(env=env))
        for name, (script_name, overrides, env) in runs.items()
    }
    wait_all(started.values())
    return started


def choosing(trainer, model):
    """A case's own trainer and model: what ``trainer=... model=...`` on the command line choose."""
    return {"defaults": [{"override /trainer": trainer}, {"override /model": model}]}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The template, and one sweep that wrote a checkpoint of each strategy x model."""
    root = Path(shutil.copytree(APPS / "template", tmp_path_factory.mktemp("ckpt") / "project"))
    with nothing_outlives("the sweep that writes the checkpoints"):
        ok(
            script(
                root,
                "train",
                "hydra.sweep.dir=sweep",
                "trainer=ddp,fsdp,fsdp_sharded,fsdp_wrapped",
                "model=net,tiny",
                KEEP_ALL,
                multirun=True,
            )
        )
    for (trainer, model), job in JOBS.items():
        overrides = (root / "sweep" / str(job) / ".hydra" / "overrides.yaml").read_text()
        assert f"trainer={trainer}\n" in overrides and f"model={model}\n" in overrides, overrides
    checkpoint_sums(root.glob("sweep/*/checkpoints/*.ckpt"))  # read at once, in one process
    return root


UNINTERRUPTED = [(trainer, "net") for trainer in ("ddp", "fsdp", "fsdp_sharded", "fsdp_wrapped")] + [
    ("fsdp", "tiny")
]
RESUMES = [  # written_by, model, resumed_by, devices
    ("fsdp", "net", "fsdp", 2),
    ("fsdp", "tiny", "fsdp", 2),
    ("fsdp_sharded", "net", "fsdp_sharded", 2),
    ("fsdp", "net", "fsdp", 3),  # saved on 2 ranks, resumed on 3
    ("fsdp_sharded", "net", "fsdp_sharded", 3),
    ("ddp", "net", "fsdp", 2),
    ("fsdp", "net", "ddp", 2),
    ("fsdp_wrapped", "net", "fsdp_wrapped", 2),  # FSDP units inside the pickled net
    ("fsdp_wrapped", "net", "ddp", 2),
]


@pytest.fixture(scope="module")
def resumed(project):
    """One sweep of train.py: each resumed fit (fit(ckpt_path=last) of a checkpoint the project's
    sweep wrote, to three epochs), a job each; and three epochs in one fit of each trainer and
    model resumed, for the resumed fits (two, then one more) to be compared with. {case: job dir}"""
    cases = {
        f"uninterrupted_{trainer}_{model}": {
            **choosing(trainer, model),
            "trainer.max_epochs": 3,
            "test": False,
        }
        for trainer, model in UNINTERRUPTED
    }
    for written_by, model, resumed_by, devices in RESUMES:
        cases[f"resume_{written_by}_{model}_{resumed_by}_{devices}"] = {
            **choosing(resumed_by, model),
            "trainer.devices": devices,
            "trainer.max_epochs": 3,
            "ckpt_path": str(checkpoint(project, written_by, model)),
        }
    with nothing_outlives("the sweep of resumed fits"):
        ok(script(project, "train", "hydra.sweep.dir=resumed",
                  *case_overrides(project / "resume_cases", cases), multirun=True))  # fmt: skip
    return {case: project / "resumed" / case for case in cases}


def checkpoint(project, trainer, model, name="last.ckpt"):
    return project / "sweep" / str(JOBS[trainer, model]) / "checkpoints" / name


def assert_loaded(job_dir, stage, expected_sum, world):
    seen = records(job_dir, stage)
    assert sorted(seen) == list(range(world)), f"ranks that recorded {stage}: {sorted(seen)}"
    for rank in seen.values():
        assert rank["world"] == world
        assert rank["weight_sum"] == pytest.approx(expected_sum, rel=1e-9, abs=1e-9), (stage, rank)
    return seen


@pytest.mark.parametrize("trainer", ["fsdp", "fsdp_sharded", "fsdp_wrapped", "ddp"])
@pytest.mark.parametrize("model", ["net", "tiny"])
def test_fit_then_test_best_in_the_same_job(project, trainer, model):
    """The template's own sweep: fit, then test(ckpt_path=best) on every rank."""
    job_dir = project / "sweep" / str(JOBS[trainer, model])
    tested = records(job_dir, "test")
    best = tested[0]["ckpt_path"]
    assert Path(best).parent == job_dir / "checkpoints" and Path(best).name.startswith("epoch_")
    assert_loaded(job_dir, "test", checkpoint_sum(best), world=2)
    if trainer != "ddp":
        assert sorted(rank["params_held"] for rank in tested.values()) == [160, 161]


STAGED = ("fsdp", "fsdp_sharded")


@pytest.fixture(scope="module")
def staged(project):
    """One sweep of the template's stages.py, a job for each trainer of STAGED."""
    with nothing_outlives("the sweep of stages.py"):
        proc = ok(script(project, "stages", "hydra.sweep.dir=stages", f"trainer={','.join(STAGED)}",
                         "model=net", KEEP_ALL, "trainer.max_epochs=3", multirun=True))  # fmt: skip
    checkpoint_sums(project.glob("stages/*/checkpoints/*.ckpt"))
    return {trainer: project / "stages" / str(job) for job, trainer in enumerate(STAGED)}, proc


@pytest.mark.parametrize("trainer", STAGED)
def test_validate_test_predict_load_what_fit_wrote(staged, trainer):
    """After fit in one job: validate(best), test(a path) and predict(last) each load theirs."""
    jobs, proc = staged
    job_dir = jobs[trainer]
    assert f"trainer={trainer}\n" in (job_dir / ".hydra" / "overrides.yaml").read_text()
    checkpoints = job_dir / "checkpoints"
    fitted = records(job_dir, "fit")[0]["weight_sum"]
    first = checkpoint_sum(checkpoints / "epoch_000.ckpt")
    assert first != pytest.approx(fitted), "the test of epoch_000 must load other weights than fit ended with"
    validated = assert_loaded(
        job_dir, "validate", checkpoint_sum(records(job_dir, "validate")[0]["ckpt_path"]), 2
    )
    assert Path(validated[0]["ckpt_path"]).parent == checkpoints
    assert_loaded(job_dir, "test", first, 2)
    assert_loaded(job_dir, "predict", checkpoint_sum(checkpoints / "last.ckpt"), 2)
    print(f"fit, validate, test, predict with {', '.join(STAGED)}: {proc.seconds:.1f} s")


@pytest.mark.parametrize("written_by, model, resumed_by, devices", RESUMES)
def test_resume_fit(project, resumed, written_by, model, resumed_by, devices):
    """fit(ckpt_path=last): the weights, epoch and step of the checkpoint, and training goes on."""
    source = checkpoint(project, written_by, model)
    run_dir = resumed[f"resume_{written_by}_{model}_{resumed_by}_{devices}"]
    started = assert_loaded(run_dir, "train_start", checkpoint_sum(source), devices)
    assert {(rank["epoch"], rank["global_step"]) for rank in started.values()} == {(2, 8)}
    fitted = records(run_dir, "fit")
    assert {rank["epoch"] for rank in fitted.values()} == {3}
    assert len({rank["weight_sum"] for rank in fitted.values()}) == 1
    if devices == 2:  # the optimizer's state was restored too: as if fit had never stopped
        reference = records(resumed[f"uninterrupted_{resumed_by}_{model}"], "fit")[0]
        assert fitted[0]["weight_sum"] == pytest.approx(reference["weight_sum"], rel=1e-6)


EVALS = {  # case: trainer, devices, the checkpoint tested (written by the project's sweep, model=net)
    **{
        f"{trainer}_{devices}": (trainer, devices, "fsdp")
        for trainer in ("fsdp", "ddp")
        for devices in (1, 2, 3)
    },
    "eval_of_ddp": ("fsdp", 3, "ddp"),
    "eval_sharded": ("fsdp_sharded", 3, "fsdp_sharded"),
}


@pytest.fixture(scope="module")
def evaluated(project):
    """One sweep of the template's eval.py, a new run that tests a checkpoint: a job for each of
    EVALS. {case: (job dir, the checkpoint it tested)}"""
    sources = {
        case: checkpoint(project, written_by, "net", "epoch_000.ckpt")
        for case, (_, _, written_by) in EVALS.items()
    }
    cases = {
        case: {**choosing(trainer, "net"), "trainer.devices": devices, "ckpt_path": str(sources[case])}
        for case, (trainer, devices, _) in EVALS.items()
    }
    with nothing_outlives("the sweep of eval.py"):
        ok(script(project, "eval", "hydra.sweep.dir=eval", *case_overrides(project / "eval_cases", cases),
                  multirun=True))  # fmt: skip
    return {case: (project / "eval" / case, sources[case]) for case in cases}


def test_eval_run_on_1_2_3_ranks_and_across_strategies(evaluated):
    """The template's eval.py, a new run: test(ckpt_path=path) of a checkpoint FSDP wrote, under
    HydraFSDP and HydraDDP on 1, 2 and 3 ranks; and of one DDP wrote, under HydraFSDP."""
    for trainer in ("fsdp", "ddp"):
        for devices in (1, 2, 3):
            job, source = evaluated[f"{trainer}_{devices}"]
            seen = assert_loaded(job, "test", checkpoint_sum(source), devices)
            assert {rank["strategy"] for rank in seen.values()} == {
                f"hydra_fsdp.lightning.Hydra{trainer.upper()}"
            }
            assert {rank["ckpt_path"] for rank in seen.values()} == {str(source)}
    job, source = evaluated["eval_of_ddp"]
    assert source.parent.parent.name == str(JOBS["ddp", "net"])
    assert_loaded(job, "test", checkpoint_sum(source), 3)


def test_eval_of_a_sharded_checkpoint_on_3_ranks(evaluated):
    job, source = evaluated["eval_sharded"]
    assert source.parent.parent.name == str(JOBS["fsdp_sharded", "net"])
    assert_loaded(job, "test", checkpoint_sum(source), 3)


def test_stock_ddp_loads_what_hydra_fsdp_wrote(project):
    """A user who drops hydra_fsdp keeps their checkpoints: Lightning's own strategy="ddp"."""
    sources = {}
    for trainer in ("fsdp", "fsdp_sharded"):
        source = checkpoint(project, trainer, "net")
        sources[trainer] = consolidated(source) if source.is_dir() else source
    runs = scripts_at_once(project, {  # the two runs side by side
        trainer: ("eval", [f"hydra.run.dir=stock_ddp_of_{trainer}", "trainer=ddp", "trainer.strategy=ddp",
                           "model=net", f"ckpt_path={source}"], TRUSTED)
        for trainer, source in sources.items()
    })  # fmt: skip
    for trainer, source in sources.items():
        ok(runs[trainer])
        seen = assert_loaded(project / f"stock_ddp_of_{trainer}", "test", checkpoint_sum(source), 2)
        assert {rank["strategy"] for rank in seen.values()} == {
            "lightning.pytorch.strategies.ddp.DDPStrategy"
        }


OUTSIDE_A_TRAINER = """
import json, sys, torch
sys.path.insert(0, ".")
from src.models import NetLitModule, TinyLitModule
found = {}
for path in sys.argv[1:]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    net = checkpoint["hyper_parameters"].get("net")
    lit_module = NetLitModule if net is not None else TinyLitModule
    module = lit_module.load_from_checkpoint(path, map_location="cpu")
    state_dict = checkpoint["state_dict"]
    found[path] = {
        "state_dict": {name: tensor.double().sum().item() for name, tensor in state_dict.items()},
        "loaded": {name: tensor.double().sum().item() for name, tensor in module.state_dict().items()},
        "pickled_net": None if net is None else
            {name: [list(p.shape), p.double().sum().item()] for name, p in net.state_dict().items()},
    }
print(json.dumps(found))
"""


def test_load_from_checkpoint_and_torch_load_outside_a_trainer(project):
    """Model.load_from_checkpoint and a plain torch.load hold the trained weights, the pickled
    net among them (FSDP used to pickle rank 0's shard of it: a flat tensor and empty ones)."""
    models = {
        str(checkpoint(project, trainer, model)): model
        for trainer, model in JOBS
        if trainer != "fsdp_sharded"
    }
    models[str(consolidated(checkpoint(project, "fsdp_sharded", "net")))] = "net"
    proc = subprocess.run([sys.executable, "-c", OUTSIDE_A_TRAINER, *models], cwd=project,
                          env=app_env(env=TRUSTED), capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert sorted(found) == sorted(models)
    shapes = {"0.weight": [32, 8], "0.bias": [32], "2.weight": [1, 32], "2.bias": [1]}
    for path, seen in found.items():
        assert seen["loaded"] == pytest.approx(seen["state_dict"]), path
        net = seen["pickled_net"]
        assert (net is not None) == (models[path] == "net"), path
        if net is not None:
            assert {name: shape for name, (shape, _) in net.items()} == shapes, path
            assert {name: total for name, (_, total) in net.items()} == pytest.approx(
                {name[len("net.") :]: total for name, total in seen["state_dict"].items()}
            ), path


def test_weights_only_is_honoured(project):
    """Lightning's weights_only (None: torch's default, True since torch 2.6) refuses the pickled
    net under HydraFSDP as under DDP, at once on every rank; a checkpoint of plain numbers loads,
    in the job after the refused ones. One sweep of eval.py, a job each."""
    refused = ("fsdp", "fsdp_sharded", "ddp")
    cases = {
        **{
            f"refused_{trainer}": {
                **choosing(trainer, "net"),
                "ckpt_path": str(checkpoint(project, trainer, "net")),
            }
            for trainer in refused
        },
        "plain": {**choosing("fsdp", "tiny"), "ckpt_path": str(checkpoint(project, "fsdp", "tiny"))},
    }
    overrides = case_overrides(project / "weights_only_cases", cases)
    with nothing_outlives("the sweep of eval.py that loads with weights_only"):
        proc = script(project, "eval", "hydra.sweep.dir=weights_only", *overrides, env={}, multirun=True)
    assert proc.returncode != 0  # Hydra raises the first failed job's error when the sweep ends
    for trainer in refused:
        job_dir = project / "weights_only" / f"refused_{trainer}"
        log = job_dir / "eval.log"  # the job's own log, where the template's task_wrapper logs its error
        assert "Weights only load failed" in log.read_text() and "TinyNet" in log.read_text(), log.read_text()
        # the job failed at once: its log's last write within 60 s of its config's
        assert log.stat().st_mtime - (job_dir / ".hydra" / "config.yaml").stat().st_mtime < 60
        assert not records(job_dir, "test")
    assert_loaded(
        project / "weights_only" / "plain", "test", checkpoint_sum(checkpoint(project, "fsdp", "tiny")), 2
    )


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("trainer", ["fsdp", "fsdp_sharded"])
def test_two_gpu_checkpoints_load(project, trainer):
    """The same load paths on CUDA/NCCL: fit then test(best), resume, and an eval run on 1 and 2 GPUs."""
    gpu = "trainer.accelerator=gpu"
    ok(
        script(
            project, "train", f"hydra.run.dir=gpu_{trainer}", f"trainer={trainer}", "model=net", gpu, KEEP_ALL
        )
    )
    job_dir = project / f"gpu_{trainer}"
    assert_loaded(job_dir, "test", checkpoint_sum(records(job_dir, "test")[0]["ckpt_path"]), 2)
    last = job_dir / "checkpoints" / "last.ckpt"
    ok(script(project, "train", f"hydra.run.dir=gpu_resume_{trainer}", f"trainer={trainer}", "model=net", gpu,
              "trainer.max_epochs=3", f"ckpt_path={last}"))  # fmt: skip
    assert_loaded(project / f"gpu_resume_{trainer}", "train_start", checkpoint_sum(last), 2)
    first = job_dir / "checkpoints" / "epoch_000.ckpt"
    ok(script(project, "eval", f"hydra.sweep.dir=gpu_eval_{trainer}", f"trainer={trainer}", "model=net", gpu,
              "trainer.devices=1,2", f"ckpt_path={first}", multirun=True))  # fmt: skip
    for job, devices in ((0, 1), (1, 2)):
        assert_loaded(project / f"gpu_eval_{trainer}" / str(job), "test", checkpoint_sum(first), devices)
