"""Every checkpoint HydraFSDP writes loads, in every way users load one (issue 17).

The app is the lightning-hydra-template-shaped one (tests/apps/template): ``model=net`` is the
template's own trait, a ``net`` nn.Module built by the config and kept in the hyperparameters by
``save_hyperparameters(logger=False)``, which pickles the module into every checkpoint;
``model=tiny`` keeps only numbers there. One sweep writes a checkpoint of each (DDP, FSDP full,
FSDP sharded) x (net, tiny); the tests load them by resuming, by testing in a new run (the
template's eval.py) on 1, 2 and 3 ranks, across strategies, and outside any Trainer. Each rank
records the sum of the weights it holds at the stage, its own (``local_weight_sum``: its shard, for
FSDP; its full copy, for DDP) and all ranks' (gathered, for FSDP): its own must be its part of the
checkpoint it loaded (``should_hold``), the gathered one that checkpoint's sum. "Best" is the first
epoch's checkpoint (the checkpoint callback's mode set to max, BEST_IS_FIRST), other weights than
the last's, which fit ended with: a load of "best" that loaded nothing, or the last, shows.

The sweeps run two at a time, then three (scripts_at_once): the one that writes the checkpoints beside
stages.py's, which needs none of them; then the resumed fits, the new runs of eval.py (those that
load a pickled net under weights_only among them) and the runs of Lightning's own DDP, each one sweep
of cases (tests/shared.py's case_overrides), each test asserting on its jobs' directories.

Loading a pickled nn.Module is refused by torch's default ``weights_only=True`` (torch >= 2.6),
under DDP as under FSDP: the runs that load one set ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, the
user's own way to allow it, and one test checks the refusal.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import Run, app_env, copy_template, ok, records, run, wait_all
from shared import case_overrides, nothing_outlives

pytestmark = pytest.mark.fsdp_cpu  # every test loads what HydraFSDP wrote on the CPU

TRUSTED = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
KEEP_ALL = "+callbacks.model_checkpoint.save_top_k=-1"  # epoch_000 differs from last: a load shows
# "best" the highest validation loss: the first epoch's (training lowers it), not the last's
BEST_IS_FIRST = "callbacks.model_checkpoint.mode=max"
# what each rank holds of the weights, by trainer config: a full copy; its part of HydraFSDP's one flat
# parameter, padded and split evenly; or of each Linear's (fsdp_wrapped: an FSDP unit each)
LAYOUT = {"ddp": "full", "fsdp": "flat", "fsdp_sharded": "flat", "fsdp_wrapped": "wrapped"}
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
def parts(tensors, world):  # each rank's [sum, size] of the tensors flattened into one, padded, split evenly
    flat = torch.cat([tensor.flatten() for tensor in tensors])
    size = -(-flat.numel() // world)
    return [[float(flat[r * size : (r + 1) * size].sum()), flat[r * size : (r + 1) * size].numel()]
            for r in range(world)]
found = {}
for path in files:
    state_dict = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    # the parameters in the module's order (FSDP flattens them so): by layer, a weight before its bias
    names = sorted(state_dict, key=lambda name: (name.rsplit(".", 1)[0], name.endswith(".bias")))
    tensors = [state_dict[name].double() for name in names]
    units = {}
    for name in names:
        units.setdefault(name.rsplit(".", 1)[0], []).append(state_dict[name].double())
    held = {}
    for world in (1, 2, 3):
        wrapped = [[0.0, 0] for _ in range(world)]
        for unit in units.values():
            for rank, (total, size) in enumerate(parts(unit, world)):
                wrapped[rank] = [wrapped[rank][0] + total, wrapped[rank][1] + size]
        full = [float(sum(tensor.sum() for tensor in tensors)), sum(tensor.numel() for tensor in tensors)]
        held[world] = {"full": [full] * world, "flat": parts(tensors, world), "wrapped": wrapped}
    found[path] = {"sum": sum(float(tensor.double().sum()) for tensor in state_dict.values()), "held": held}
print(json.dumps(found))
"""
SUMS = {}  # checkpoint path: the sum of its weights
HELD = {}  # checkpoint path: {world: {layout: each rank's [sum, size] of its part of the weights}}


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
        for file, found in json.loads(proc.stdout.splitlines()[-1]).items():
            SUMS[file], HELD[file] = found["sum"], found["held"]
    return {path: SUMS[str(file)] for path, file in files.items()}


def checkpoint_sum(path):
    return checkpoint_sums([path])[str(path)]


def should_hold(path, trainer, world):
    """What each rank of ``world`` under ``trainer``'s config should hold of the checkpoint ``path`` once it
    loaded it: [[the sum of its part of the weights, their number]] by rank, read from the checkpoint."""
    checkpoint_sums([path])
    path = Path(path)
    file = path.with_name(path.name + ".consolidated") if path.is_dir() else path
    return HELD[str(file)][str(world)][LAYOUT[trainer]]


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


STAGED = ("fsdp", "fsdp_sharded")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The template, and two sweeps side by side: one that wrote a checkpoint of each strategy x model,
    and one of the template's stages.py, a job for each trainer of STAGED (it loads only what it wrote).
    {"project": the template's root, "staged": ({trainer: job dir}, its Run)}"""
    root = copy_template(tmp_path_factory.mktemp("ckpt") / "project")
    with nothing_outlives("the sweeps that write the checkpoints"):
        runs = scripts_at_once(root, {
            "project": ("train", ["-m", "hydra.sweep.dir=sweep", "trainer=ddp,fsdp,fsdp_sharded,fsdp_wrapped",
                                  "model=net,tiny", KEEP_ALL, BEST_IS_FIRST], TRUSTED),
            "staged": ("stages", ["-m", "hydra.sweep.dir=stages", f"trainer={','.join(STAGED)}", "model=net",
                                  KEEP_ALL, BEST_IS_FIRST, "trainer.max_epochs=3"], TRUSTED),
        })  # fmt: skip
    ok(runs["project"])
    for (trainer, model), job in JOBS.items():
        overrides = (root / "sweep" / str(job) / ".hydra" / "overrides.yaml").read_text()
        assert f"trainer={trainer}\n" in overrides and f"model={model}\n" in overrides, overrides
    # read at once, in one process
    checkpoint_sums([*root.glob("sweep/*/checkpoints/*.ckpt"), *root.glob("stages/*/checkpoints/*.ckpt")])
    staged = {trainer: root / "stages" / str(job) for job, trainer in enumerate(STAGED)}
    return {"project": root, "staged": (staged, runs["staged"])}


@pytest.fixture(scope="module")
def project(written):
    """The template's root, where one sweep wrote a checkpoint of each strategy x model."""
    return written["project"]


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


def resume_cases(project):
    """The cases of one sweep of train.py: each resumed fit (fit(ckpt_path=last) of a checkpoint the
    project's sweep wrote, to three epochs), a job each; and three epochs in one fit of each trainer and
    model resumed, for the resumed fits (two, then one more) to be compared with."""
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
    return cases


def checkpoint(project, trainer, model, name="last.ckpt"):
    return project / "sweep" / str(JOBS[trainer, model]) / "checkpoints" / name


def log_tail(job_dir):
    logs = sorted(Path(job_dir).glob("*.log"))
    return "".join(f"\n--- {log}:\n{log.read_text()[-3000:]}" for log in logs)


def assert_loaded(job_dir, stage, source, world, trainer):
    """Every rank of the job's ``world`` recorded ``stage`` holding the checkpoint ``source``'s weights, as
    ``trainer``'s config shards them: the sum of all of them (gathered, for FSDP), and its own part of
    them (its shard, or for DDP the full copy), told by their sum and number."""
    seen = records(job_dir, stage)
    ranks = sorted(seen)
    assert ranks == list(range(world)), f"ranks that recorded {stage}: {ranks}" + log_tail(job_dir)
    expected_sum, parts = checkpoint_sum(source), should_hold(source, trainer, world)
    for number, rank in seen.items():
        assert rank["world"] == world
        assert rank["weight_sum"] == pytest.approx(expected_sum, rel=1e-9, abs=1e-9), (stage, rank)
        local, size = parts[number]
        held = (rank["params_held"], rank["local_weight_sum"])
        assert held == (size, pytest.approx(local, rel=1e-9, abs=1e-9)), (
            f"rank {number} holds other weights at {stage} than its part of {source}: {parts}",
            rank,
        )
    return seen


@pytest.mark.parametrize("trainer", ["fsdp", "fsdp_sharded", "fsdp_wrapped", "ddp"])
@pytest.mark.parametrize("model", ["net", "tiny"])
def test_fit_then_test_best_in_the_same_job(project, trainer, model):
    """The template's own sweep: fit, then test(ckpt_path=best) on every rank."""
    job_dir = project / "sweep" / str(JOBS[trainer, model])
    tested = records(job_dir, "test")
    best = tested[0]["ckpt_path"]
    assert Path(best).parent == job_dir / "checkpoints" and Path(best).name.startswith("epoch_")
    # the best is the first epoch's (BEST_IS_FIRST), other weights than the last's, which every rank held
    # as fit ended: a test that loaded nothing, or the last, shows
    last = job_dir / "checkpoints" / "last.ckpt"
    assert Path(best).name == "epoch_000.ckpt", best
    assert checkpoint_sum(best) != pytest.approx(checkpoint_sum(last)), "best must hold other weights"
    assert_loaded(job_dir, "fit", last, 2, trainer)
    assert_loaded(job_dir, "test", best, world=2, trainer=trainer)
    if trainer != "ddp":
        assert sorted(rank["params_held"] for rank in tested.values()) == [160, 161]


@pytest.fixture(scope="module")
def staged(written):
    """The sweep of the template's stages.py, a job for each trainer of STAGED: ({trainer: job dir}, its
    Run). Written beside the project's sweep (see written)."""
    jobs, proc = written["staged"]
    return jobs, ok(proc)


@pytest.mark.parametrize("trainer", STAGED)
def test_validate_test_predict_load_what_fit_wrote(staged, trainer):
    """After fit in one job: validate(best), test(a path) and predict(last) each load theirs, each
    other weights than the stage before it left (a load that loaded nothing shows): fit ends with the
    last's, best is the first epoch's (BEST_IS_FIRST), the path tested the second's."""
    jobs, proc = staged
    job_dir = jobs[trainer]
    assert f"trainer={trainer}\n" in (job_dir / ".hydra" / "overrides.yaml").read_text()
    checkpoints = job_dir / "checkpoints"
    fitted = records(job_dir, "fit")[0]["weight_sum"]
    best, second, last = (checkpoints / name for name in ("epoch_000.ckpt", "epoch_001.ckpt", "last.ckpt"))
    assert checkpoint_sum(last) == pytest.approx(fitted, rel=1e-9, abs=1e-9)
    assert_loaded(job_dir, "fit", last, 2, trainer)
    for earlier, loaded in ((last, best), (best, second), (second, last)):
        assert checkpoint_sum(loaded) != pytest.approx(checkpoint_sum(earlier)), (
            f"{loaded.name} must hold other weights than {earlier.name}, the stage before it left"
        )
    assert checkpoint_sum(second) != pytest.approx(fitted), "the test must load other weights than fit's"
    validated = assert_loaded(job_dir, "validate", records(job_dir, "validate")[0]["ckpt_path"], 2, trainer)
    assert Path(validated[0]["ckpt_path"]).parent == checkpoints
    assert Path(validated[0]["ckpt_path"]) == best, "validate(best) must load the first epoch's"
    assert {rank["ckpt_path"] for rank in records(job_dir, "test").values()} == {str(second)}
    assert_loaded(job_dir, "test", second, 2, trainer)
    assert_loaded(job_dir, "predict", last, 2, trainer)
    print(f"fit, validate, test, predict with {', '.join(STAGED)}: {proc.seconds:.1f} s")


@pytest.mark.parametrize("written_by, model, resumed_by, devices", RESUMES)
def test_resume_fit(project, resumed, written_by, model, resumed_by, devices):
    """fit(ckpt_path=last): the weights, epoch and step of the checkpoint, and training goes on."""
    source = checkpoint(project, written_by, model)
    run_dir = resumed[f"resume_{written_by}_{model}_{resumed_by}_{devices}"]
    started = assert_loaded(run_dir, "train_start", source, devices, resumed_by)
    assert {(rank["epoch"], rank["global_step"]) for rank in started.values()} == {(2, 8)}
    fitted = records(run_dir, "fit")
    assert {rank["epoch"] for rank in fitted.values()} == {3}
    assert len({rank["weight_sum"] for rank in fitted.values()}) == 1
    if devices == 2:  # the optimizer's state was restored too: as if fit had never stopped
        references = records(resumed[f"uninterrupted_{resumed_by}_{model}"], "fit")
        assert fitted[0]["weight_sum"] == pytest.approx(references[0]["weight_sum"], rel=1e-6)
        for number, reference in references.items():  # on every rank, its own part (the same trainer)
            assert (fitted[number]["params_held"], fitted[number]["local_weight_sum"]) == (
                reference["params_held"],
                pytest.approx(reference["local_weight_sum"], rel=1e-6, abs=1e-6),
            ), (number, fitted[number], reference)


EVALS = {  # case: trainer, devices, the checkpoint tested (written by the project's sweep, model=net)
    **{
        f"{trainer}_{devices}": (trainer, devices, "fsdp")
        for trainer in ("fsdp", "ddp")
        for devices in (1, 2, 3)
    },
    "eval_of_ddp": ("fsdp", 3, "ddp"),
    "eval_sharded": ("fsdp_sharded", 3, "fsdp_sharded"),
}


REFUSED = ("fsdp", "fsdp_sharded", "ddp")  # the trainers that load a pickled net under weights_only
STOCK_DDP_OF = ("fsdp", "fsdp_sharded")  # the trainers whose checkpoints Lightning's own DDP loads
# a job's own way to allow loading a pickled nn.Module (what TRUSTED does for a whole run)
TRUSTED_JOB = {f"hydra.job.env_set.{key}": value for key, value in TRUSTED.items()}


@pytest.fixture(scope="module")
def loads(project):
    """Three sweeps side by side, each of cases, that load what the project's sweep wrote.
    "resumed": train.py, resume_cases (TRUSTED); "eval": eval.py, a new run that tests a checkpoint, a
    job for each of EVALS (each TRUSTED_JOB), then one of a pickled net for each of REFUSED and "plain",
    one of plain numbers, loaded under torch's default weights_only (the run itself not TRUSTED);
    "stock_ddp": eval.py under Lightning's own strategy="ddp", a job for each of STOCK_DDP_OF (TRUSTED).
    Lightning starts its child rank with the sweep's own command line, where the child runs the same
    sweep beside rank 0, job for job: a sweep of stock-DDP jobs alone. {name: ({case: job dir}, its Run)}"""
    sources = {
        case: checkpoint(project, written_by, "net", "epoch_000.ckpt")
        for case, (_, _, written_by) in EVALS.items()
    }
    eval_cases = {
        case: {
            **choosing(trainer, "net"),
            "trainer.devices": devices,
            "ckpt_path": str(sources[case]),
            **TRUSTED_JOB,
        }
        for case, (trainer, devices, _) in EVALS.items()
    }
    for trainer in REFUSED:  # after the trusted jobs: none of what they were allowed reaches these
        eval_cases[f"refused_{trainer}"] = {
            **choosing(trainer, "net"),
            "ckpt_path": str(checkpoint(project, trainer, "net")),
        }
    eval_cases["plain"] = {**choosing("fsdp", "tiny"), "ckpt_path": str(checkpoint(project, "fsdp", "tiny"))}
    stock_cases = {}
    for trainer in STOCK_DDP_OF:
        source = checkpoint(project, trainer, "net")
        source = consolidated(source) if source.is_dir() else source
        stock_cases[f"stock_ddp_of_{trainer}"] = {
            **choosing("ddp", "net"),
            "trainer.strategy": "ddp",
            "ckpt_path": str(source),
        }
    sweeps = {
        "resumed": ("train", resume_cases(project), TRUSTED),
        "eval": ("eval", eval_cases, {}),
        "stock_ddp": ("eval", stock_cases, TRUSTED),
    }
    with nothing_outlives("the sweeps that load the checkpoints"):
        runs = scripts_at_once(project, {
            name: (name_of_script, ["-m", f"hydra.sweep.dir={name}",
                                    *case_overrides(project / f"{name}_cases", cases)], env)
            for name, (name_of_script, cases, env) in sweeps.items()
        })  # fmt: skip
    return {
        name: ({case: project / name / case for case in cases}, runs[name])
        for name, (_, cases, _) in sweeps.items()
    }


@pytest.fixture(scope="module")
def resumed(loads):
    """{case: job dir} of the sweep of resumed fits (see loads)."""
    jobs, proc = loads["resumed"]
    ok(proc)
    return jobs


def assert_job_passed(job_dir):
    """The job raised nothing: the template's task_wrapper logs what the task raises in the job's log."""
    log = Path(job_dir) / "eval.log"
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


@pytest.fixture(scope="module")
def evaluated(loads):
    """The jobs of eval.py's sweep that test a checkpoint, one of EVALS each (see loads); each job
    passed (the sweep itself fails: its jobs of REFUSED do). {case: (job dir, the checkpoint it tested)}"""
    jobs, _ = loads["eval"]
    found = {}
    for case, (_, _, written_by) in EVALS.items():
        assert_job_passed(jobs[case])
        found[case] = jobs[case], checkpoint(project_of(jobs[case]), written_by, "net", "epoch_000.ckpt")
    return found


def test_eval_run_on_1_2_3_ranks_and_across_strategies(evaluated):
    """The template's eval.py, a new run: test(ckpt_path=path) of a checkpoint FSDP wrote, under
    HydraFSDP and HydraDDP on 1, 2 and 3 ranks; and of one DDP wrote, under HydraFSDP."""
    for trainer in ("fsdp", "ddp"):
        for devices in (1, 2, 3):
            job, source = evaluated[f"{trainer}_{devices}"]
            seen = assert_loaded(job, "test", source, devices, trainer)
            assert {rank["strategy"] for rank in seen.values()} == {
                f"hydra_fsdp.lightning.Hydra{trainer.upper()}"
            }
            assert {rank["ckpt_path"] for rank in seen.values()} == {str(source)}
    job, source = evaluated["eval_of_ddp"]
    assert source.parent.parent.name == str(JOBS["ddp", "net"])
    assert_loaded(job, "test", source, 3, "fsdp")


def test_eval_of_a_sharded_checkpoint_on_3_ranks(evaluated):
    job, source = evaluated["eval_sharded"]
    assert source.parent.parent.name == str(JOBS["fsdp_sharded", "net"])
    assert_loaded(job, "test", source, 3, "fsdp_sharded")


def test_stock_ddp_loads_what_hydra_fsdp_wrote(project, loads):
    """A user who drops hydra_fsdp keeps their checkpoints: Lightning's own strategy="ddp" (a sweep of
    its own, see loads)."""
    jobs, proc = loads["stock_ddp"]
    ok(proc)
    for trainer in STOCK_DDP_OF:
        source = checkpoint(project, trainer, "net")
        source = consolidated(source) if source.is_dir() else source
        seen = assert_loaded(jobs[f"stock_ddp_of_{trainer}"], "test", source, 2, "ddp")
        assert {rank["ckpt_path"] for rank in seen.values()} == {str(source)}
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


def test_weights_only_is_honoured(project, loads):
    """Lightning's weights_only (None: torch's default, True since torch 2.6) refuses the pickled
    net under HydraFSDP as under DDP, at once on every rank; a checkpoint of plain numbers loads,
    in the job after the refused ones. Jobs of eval.py's sweep (see loads), a job each."""
    jobs, proc = loads["eval"]
    assert proc.returncode != 0  # Hydra raises the first failed job's error when the sweep ends
    for trainer in REFUSED:
        job_dir = jobs[f"refused_{trainer}"]
        for rank in (0, 1):
            # each rank's own log: rank 0's the job's, where the template's task_wrapper logs its error;
            # a child rank's the one hydra_fsdp keeps of it, where its error goes
            log = job_dir / ("eval.log" if rank == 0 else f"rank_{rank}.log")
            text = log.read_text()
            assert "Weights only load failed" in text and "TinyNet" in text, (rank, text[-5000:])
            # the rank failed at once: its log's last write within 60 s of the job's config's
            assert log.stat().st_mtime - (job_dir / ".hydra" / "config.yaml").stat().st_mtime < 60, rank
        assert not records(job_dir, "test")
    assert_loaded(jobs["plain"], "test", checkpoint(project, "fsdp", "tiny"), 2, "fsdp")


NET_DEVICES = """
import sys, torch
sys.path.insert(0, ".")  # the checkpoint pickles the app's own classes
net = torch.load(sys.argv[1], weights_only=False)["hyper_parameters"]["net"]  # where each was saved from
print(*sorted({str(p.device) for p in net.parameters()}))
"""


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
    assert_loaded(job_dir, "test", records(job_dir, "test")[0]["ckpt_path"], 2, trainer)
    if trainer == "fsdp_sharded":  # the pickled net was gathered to the CPU, not onto rank 0's GPU
        metadata = job_dir / "checkpoints" / "last.ckpt" / "meta.pt"
        devices = subprocess.run([sys.executable, "-c", NET_DEVICES, str(metadata)], cwd=project,
                                 env=app_env(env=TRUSTED), capture_output=True, text=True, timeout=120,
                                 check=True).stdout.split()  # fmt: skip
        assert devices == ["cpu"], devices
    last = job_dir / "checkpoints" / "last.ckpt"
    ok(script(project, "train", f"hydra.run.dir=gpu_resume_{trainer}", f"trainer={trainer}", "model=net", gpu,
              "trainer.max_epochs=3", f"ckpt_path={last}"))  # fmt: skip
    assert_loaded(project / f"gpu_resume_{trainer}", "train_start", last, 2, trainer)
    first = job_dir / "checkpoints" / "epoch_000.ckpt"
    ok(script(project, "eval", f"hydra.sweep.dir=gpu_eval_{trainer}", f"trainer={trainer}", "model=net", gpu,
              "trainer.devices=1,2", f"ckpt_path={first}", multirun=True))  # fmt: skip
    for job, devices in ((0, 1), (1, 2)):
        assert_loaded(project / f"gpu_eval_{trainer}" / str(job), "test", first, devices, trainer)
