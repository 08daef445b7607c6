"""Tests for hydra_fsdp.

Unit tests mock ``subprocess.Popen`` (and the stagger's sleep) to pin what a launch runs.
End-to-end tests run real Hydra sweeps with real child processes on CPU (gloo) and assert on
what every rank recorded: config values, working directory, output dir, world size, and the
parameters it held.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

import hydra_fsdp
from hydra_fsdp import ChildRankError, HydraDDP, HydraFSDP, RankLaunchError

# --------------------------------------------------------------------------- the app under test

# A sweepable Lightning app. Every rank writes what it saw to <job dir>/seen/<stage>_rank<N>.json
# and its pid to <job dir>/started/rank<N>.json as soon as its module is built.
APP = '''
import json, os, sys, time
from pathlib import Path

import torch
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd, instantiate
import hydra
from hydra_zen import builds, make_config, store

from hydra_fsdp import HydraDDP, HydraFSDP
from shapes import Shapes

STRATEGIES = {"ddp": HydraDDP, "fsdp": HydraFSDP}


def job_dir():
    return Path(HydraConfig.get().runtime.output_dir)


def local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


class Tiny(pl.LightningModule):
    def __init__(self, lr=0.1, job=-1, tag="", stamp="", width=64, fail_rank=-1, fail_how="", fail_job=0):
        super().__init__()
        self.seen = {"lr": lr, "job": job, "tag": tag, "stamp": stamp}
        self.fail = (fail_rank if job == fail_job else -1, fail_how)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.params_total = sum(p.numel() for p in self.net.parameters())
        started = job_dir() / "started"
        started.mkdir(exist_ok=True)
        (started / f"rank{local_rank()}.json").write_text(json.dumps({
            "pid": os.getpid(),
            "env": {k: os.environ.get(k) for k in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK")},
            "process_group": torch.distributed.is_initialized(),
            "threads": sorted(t.name for t in __import__("threading").enumerate()),
        }))
        self._maybe_fail("init")

    def _maybe_fail(self, when):
        rank, how = self.fail
        if rank != local_rank() or not how.startswith(when):
            return
        if how.endswith("raise"):
            raise ValueError(f"injected failure on rank {rank}")
        if how.endswith("kill"):
            os.kill(os.getpid(), 9)
        if how.endswith("hang"):
            time.sleep(10_000)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, idx):
        if idx == 2:
            self._maybe_fail("train")
        if os.environ.get("APP_SLOW_STEPS"):
            time.sleep(float(os.environ["APP_SLOW_STEPS"]))
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    test_step = validation_step

    def predict_step(self, batch, idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.seen["lr"])

    def _data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _data

    def _record(self, stage):
        held = [p.detach() for p in self.trainer.model.parameters()]
        local_sum = torch.tensor(float(sum(p.double().sum() for p in held)), dtype=torch.float64)
        full_sum = local_sum.clone()
        torch.distributed.all_reduce(full_sum)
        datamodule = self.trainer.datamodule
        seen = dict(
            self.seen,
            stage=stage,
            rank=self.global_rank,
            world=self.trainer.world_size,
            cwd=os.getcwd(),
            output_dir=HydraConfig.get().runtime.output_dir,
            original_cwd=get_original_cwd(),
            pid=os.getpid(),
            strategy=type(self.trainer.strategy).__module__ + "." + type(self.trainer.strategy).__name__,
            params_held=sum(p.numel() for p in held),
            params_total=self.params_total,
            local_weight_sum=float(local_sum),
            weight_sum=float(full_sum),
            datamodule=None if datamodule is None else type(datamodule).__name__,
            master_port=os.environ.get("MASTER_PORT"),
        )
        if self.trainer.world_size == 1 or not isinstance(self.trainer.strategy, pl.strategies.FSDPStrategy):
            seen["weight_sum"] = float(local_sum)
        out = job_dir() / "seen"
        out.mkdir(exist_ok=True)
        (out / f"{stage}_rank{self.global_rank}.json").write_text(json.dumps(seen))

    def on_train_end(self):
        self._record("fit")

    def on_validation_end(self):
        if self.trainer.state.fn == "validate":
            self._record("validate")

    def on_test_end(self):
        self._record("test")

    def on_predict_end(self):
        self._record("predict")


Trainer = builds(
    pl.Trainer,
    accelerator="cpu",
    devices=2,
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    default_root_dir="${hydra:runtime.output_dir}",
    callbacks=None,
    strategy=builds(HydraDDP_TARGET, rank_timeout=60),
    populate_full_signature=True,
)
Config = make_config(
    trainer=Trainer,
    module=builds(
        Tiny,
        job="${hydra:job.num}",
        tag="${hydra:job.override_dirname}",
        stamp="${now:%H-%M-%S-%f}",
        populate_full_signature=True,
    ),
    datamodule=builds(Shapes),
    stages=["fit"],
    use_datamodule=False,
    # for trainer.callbacks=[${keep_last}]: lets a stage load ckpt_path="last"
    keep_last=builds(pl.callbacks.ModelCheckpoint, save_last=True),
)


def task(cfg):
    trainer = instantiate(cfg.trainer)
    module = instantiate(cfg.module)
    datamodule = instantiate(cfg.datamodule) if cfg.use_datamodule else None
    for spec in cfg.stages:
        # "<stage>[:<same|fresh module>[:<ckpt_path>]]"
        stage, which, ckpt = (spec.split(":") + ["same", "none"])[:3]
        if which == "fresh":
            module = instantiate(cfg.module)
        kwargs = {} if datamodule is None else {"datamodule": datamodule}
        if ckpt != "none":
            kwargs["ckpt_path"] = ckpt
        getattr(trainer, stage)(module, **kwargs)


if __name__ == "__main__":
    store(Config, name="config")
    store.add_to_hydra_store()
    hydra.main(config_name="config", config_path=None, version_base="1.3")(task)()
'''.replace("HydraDDP_TARGET", 'STRATEGIES[os.environ.get("APP_STRATEGY", "ddp")]')

# A datamodule in a module next to the script: child ranks must import it without PYTHONPATH.
SHAPES = '''
import torch
import pytorch_lightning as pl


class Shapes(pl.LightningDataModule):
    def _data(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(48, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _data
'''

SWEEP_TIMEOUT = 240


@pytest.fixture
def app(tmp_path):
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "shapes.py").write_text(SHAPES)
    return tmp_path


def run_app(app_dir, *overrides, strategy="ddp", env=None, timeout=SWEEP_TIMEOUT, multirun=True):
    full_env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", APP_STRATEGY=strategy, HYDRA_FULL_ERROR="1")
    full_env.pop("PYTHONPATH", None)  # the app must find its own modules, as a user's would
    full_env.update(env or {})
    command = [sys.executable, "app.py"] + (["-m"] if multirun else []) + list(overrides)
    started = time.monotonic()
    proc = subprocess.run(command, cwd=app_dir, env=full_env, capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.monotonic() - started
    return proc


def sweep_in(app_dir, *overrides, **kwargs):
    """Run a multirun into <app>/sweep, one job dir per job number."""
    return run_app(app_dir, "hydra.sweep.dir=sweep", *overrides, **kwargs)


def records(job_dir, stage="fit"):
    """What each rank of one job recorded for one stage, by rank."""
    return {
        seen["rank"]: seen
        for seen in (json.loads(p.read_text()) for p in sorted(Path(job_dir, "seen").glob(f"{stage}_rank*.json")))
    }


def started_pids(job_dir):
    return {int(p.stem[4:]): json.loads(p.read_text())["pid"] for p in Path(job_dir, "started").glob("rank*.json")}


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes: it holds no port and no memory
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def assert_ranks_agree(job_dir, stage="fit", world=2):
    seen = records(job_dir, stage)
    assert sorted(seen) == list(range(world)), f"ranks that recorded {stage}: {sorted(seen)}"
    ranks = list(seen.values())
    for key in ("lr", "job", "tag", "stamp", "cwd", "output_dir", "original_cwd", "world", "strategy"):
        assert len({json.dumps(r[key]) for r in ranks}) == 1, f"ranks disagree on {key}: {[r[key] for r in ranks]}"
    assert ranks[0]["world"] == world
    assert Path(ranks[0]["output_dir"]).resolve() == Path(job_dir).resolve()
    assert len({r["pid"] for r in ranks}) == world
    return seen


def ok(proc):
    assert proc.returncode == 0, f"sweep failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


# --------------------------------------------------------------------------- unit: the launch


class _StopAfterSpawn(ChildRankError):
    """Raised where rank 0 would wait for its children to check in: the launch ends there."""


def launch_with_mocked_children(tmp_path, strategy, devices=3, env=None, fit_kwargs=None, config=None, overrides=()):
    """Run one Hydra job (in this process) whose fit() spawns children into a mocked Popen.

    Returns (mocked Popen, mocked sleep, job dir, the job's error). The children never check in:
    the launch is stopped there, which also shows the launch's cleanup.
    """
    import pytorch_lightning as pl
    from hydra_zen import builds, launch, make_config

    if config is None:
        config = make_config(
            trainer=builds(pl.Trainer, accelerator="cpu", devices=devices, strategy=builds(strategy), logger=False),
            module=builds(torch.nn.Linear, 2, 2),
        )

    def task(cfg):
        from hydra.utils import instantiate

        trainer = instantiate(cfg.trainer)
        trainer.fit(_fit_module(), **(fit_kwargs or {}))

    with mock.patch.dict(os.environ, env or {}), mock.patch.object(
        hydra_fsdp.subprocess, "Popen"
    ) as popen, mock.patch.object(hydra_fsdp.time, "sleep") as sleep, mock.patch.object(
        hydra_fsdp._ChildRanks, "wait_until_checked_in", side_effect=_StopAfterSpawn
    ):
        popen.return_value.poll.return_value = None
        popen.return_value.pid = 4242
        try:
            launch(config, task, overrides=[f"hydra.run.dir={tmp_path / 'job'}", *overrides], version_base="1.3")
            error = None
        except BaseException as e:  # noqa: BLE001 - the job's error is what we test
            error = e
    return popen, sleep, tmp_path / "job", error


def _fit_module():
    import pytorch_lightning as pl

    class FitModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(4, 2))

    return FitModule()


@pytest.mark.parametrize("strategy", [HydraDDP, HydraFSDP])
def test_child_command_env_cwd_and_stagger(tmp_path, strategy):
    popen, sleep, job_dir, error = launch_with_mocked_children(
        tmp_path, strategy, devices=3, env={hydra_fsdp.LAUNCH_DELAY_ENV: "2.5"}
    )
    assert isinstance(error, _StopAfterSpawn)
    plan = job_dir / ".hydra" / "rank_plan.yaml"
    assert popen.call_count == 2
    ports = set()
    for rank, call in zip((1, 2), popen.call_args_list):
        assert call.args[0] == [sys.executable, os.path.abspath(hydra_fsdp.__file__), str(plan)]
        env = call.kwargs["env"]
        assert env["LOCAL_RANK"] == str(rank)
        assert (env["NODE_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "3", "127.0.0.1")
        assert env["PYTHONUNBUFFERED"] == "1"
        ports.add(env["MASTER_PORT"])
        assert call.kwargs["cwd"] == os.getcwd()
        assert call.kwargs["stdout"].name == str(job_dir / f"rank_{rank}.log")
        assert call.kwargs["stderr"] == subprocess.STDOUT
    assert len(ports) == 1
    sleep.assert_called_once_with(2.5)  # between the two child spawns, not before the first
    # the launch cleaned up: children killed and reaped, rank 0's environment as it was
    assert popen.return_value.kill.called
    for key in hydra_fsdp._RENDEZVOUS_ENV:
        assert key not in os.environ
    saved = hydra_fsdp.OmegaConf.load(plan)
    assert saved.stage == "fit" and saved.ckpt_path is None and saved.datamodule is False
    assert saved.config.module._target_ == "torch.nn.modules.linear.Linear"
    assert saved.hydra.runtime.output_dir == str(job_dir)


def test_no_stagger_for_a_single_child(tmp_path):
    popen, sleep, _, _ = launch_with_mocked_children(tmp_path, HydraDDP, devices=2)
    assert popen.call_count == 1
    sleep.assert_not_called()


def test_stagger_zero_disables_it(tmp_path):
    popen, sleep, _, _ = launch_with_mocked_children(
        tmp_path, HydraDDP, devices=4, env={hydra_fsdp.LAUNCH_DELAY_ENV: "0"}
    )
    assert popen.call_count == 3
    sleep.assert_not_called()


def test_stagger_default_is_one_second(monkeypatch):
    monkeypatch.delenv(hydra_fsdp.LAUNCH_DELAY_ENV, raising=False)
    assert hydra_fsdp._launch_delay() == 1.0
    monkeypatch.setenv(hydra_fsdp.LAUNCH_DELAY_ENV, "0.25")
    assert hydra_fsdp._launch_delay() == 0.25


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "", "1s"])
def test_bad_stagger_fails_before_any_spawn(tmp_path, value):
    popen, _, job_dir, error = launch_with_mocked_children(
        tmp_path, HydraDDP, env={hydra_fsdp.LAUNCH_DELAY_ENV: value}
    )
    assert isinstance(error, RankLaunchError)
    assert hydra_fsdp.LAUNCH_DELAY_ENV in str(error) and repr(value) in str(error)
    popen.assert_not_called()


def test_missing_saved_config_fails_before_any_spawn(tmp_path):
    popen, _, _, error = launch_with_mocked_children(tmp_path, HydraFSDP, overrides=["hydra.output_subdir=null"])
    assert isinstance(error, RankLaunchError)
    assert "hydra.output_subdir is null" in str(error)
    popen.assert_not_called()


def test_config_without_module_fails_naming_file_and_key(tmp_path):
    import pytorch_lightning as pl
    from hydra_zen import builds, make_config

    config = make_config(trainer=builds(pl.Trainer, accelerator="cpu", devices=2, strategy=builds(HydraDDP)))
    popen, _, job_dir, error = launch_with_mocked_children(tmp_path, HydraDDP, config=config)
    assert isinstance(error, RankLaunchError)
    message = str(error)
    assert str(job_dir / ".hydra" / "config.yaml") in message and "'module'" in message
    assert "module_key" in message  # the fix for configs that name it otherwise
    popen.assert_not_called()


def test_module_key_names_where_the_module_lives(tmp_path):
    import pytorch_lightning as pl
    from hydra_zen import builds, make_config

    config = make_config(
        trainer=builds(pl.Trainer, accelerator="cpu", devices=2, strategy=builds(HydraDDP, module_key="model")),
        model=builds(torch.nn.Linear, 2, 2),
    )
    popen, _, job_dir, error = launch_with_mocked_children(tmp_path, HydraDDP, config=config)
    assert isinstance(error, _StopAfterSpawn)
    assert hydra_fsdp.OmegaConf.load(job_dir / ".hydra" / "rank_plan.yaml").module_key == "model"


def test_dataloaders_passed_directly_are_refused(tmp_path):
    loader = torch.utils.data.DataLoader(torch.randn(4, 2))
    popen, _, _, error = launch_with_mocked_children(tmp_path, HydraDDP, fit_kwargs={"train_dataloaders": loader})
    assert isinstance(error, RankLaunchError) and "train_dataloaders" in str(error)
    popen.assert_not_called()


def test_outside_a_hydra_job_is_a_clear_error():
    import pytorch_lightning as pl

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HydraDDP(), logger=False)
    with mock.patch.object(hydra_fsdp.subprocess, "Popen") as popen, pytest.raises(RankLaunchError, match="no"):
        trainer.fit(_fit_module())
    popen.assert_not_called()


def test_external_launcher_spawns_nothing():
    import pytorch_lightning as pl

    env = {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "2"}
    with mock.patch.dict(os.environ, env), mock.patch.object(hydra_fsdp.subprocess, "Popen") as popen:
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HydraDDP(), logger=False)
        assert trainer.strategy.cluster_environment.creates_processes_externally
        assert trainer.strategy.launcher.launch(lambda: "ran", trainer=trainer) == "ran"
    popen.assert_not_called()


def test_external_world_size_mismatch_is_a_clear_error():
    import pytorch_lightning as pl

    env = {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "3"}
    with mock.patch.dict(os.environ, env):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HydraDDP(), logger=False)
        with pytest.raises(RankLaunchError, match=r"3 .*2"):
            trainer.strategy.launcher.launch(lambda: "ran", trainer=trainer)


@pytest.mark.parametrize(
    "text", ["plain", "a${b}", "x\\${y}", "\\\\${z}", "dir/a=1,b=[2,3],c=${d}\\e f", "end\\", "$ {x}", "${"]
)
def test_escaped_strings_read_back_literally(text):
    config = hydra_fsdp.OmegaConf.create({"value": hydra_fsdp._escaped(text)})
    assert config.value == text


# --------------------------------------------------------------------------- end to end: HydraDDP


def test_ddp_sweep_every_rank_trains_its_own_job(app):
    proc = ok(run_app(app, "module.lr=0.1,0.2"))  # Hydra's default timestamped sweep dir
    sweep_dirs = [p for p in (app / "multirun").glob("*/*") if p.is_dir()]
    assert len(sweep_dirs) == 1, f"expected one sweep dir, found {sweep_dirs}"
    sweep = sweep_dirs[0]
    ports = set()
    for job, lr in ((0, 0.1), (1, 0.2)):
        seen = assert_ranks_agree(sweep / str(job))
        assert seen[0]["lr"] == lr and seen[0]["job"] == job and seen[0]["tag"] == f"module.lr={lr}"
        assert seen[0]["cwd"] == str(app) and seen[0]["original_cwd"] == str(app)
        assert seen[0]["params_held"] == seen[0]["params_total"]  # DDP replicates
        assert seen[0]["weight_sum"] == seen[1]["weight_sum"]  # and keeps replicas equal
        assert seen[0]["strategy"] == "hydra_fsdp.HydraDDP"
        ports.add(seen[1]["master_port"])
        # rank 0's saved config is Hydra's own, untouched; the child's output went to its log
        assert "_target_: __main__.Tiny" in (sweep / str(job) / ".hydra" / "config.yaml").read_text()
        assert "GLOBAL_RANK: 1" in (sweep / str(job) / "rank_1.log").read_text()
    assert len(ports) == 2, "each job must rendezvous on its own port"
    print(f"2 jobs x 2 ranks, HydraDDP: {proc.seconds:.1f} s")


def test_single_run_without_multirun(app):
    ok(run_app(app, "hydra.run.dir=single", multirun=False))
    assert_ranks_agree(app / "single")


def test_job_dir_full_of_special_characters(app):
    note = "a=b,[c] $x {y} w\\\\v"
    ok(sweep_in(app, "hydra.sweep.subdir=${hydra.job.override_dirname}", "module.lr=0.1,0.2", f"+note='{note}'"))
    job_dirs = sorted(p for p in (app / "sweep").iterdir() if p.is_dir())
    assert len(job_dirs) == 2, job_dirs
    for job_dir in job_dirs:
        assert all(c in job_dir.name for c in "=,[]${}\\ "), job_dir.name
        seen = assert_ranks_agree(job_dir)
        assert seen[1]["output_dir"] == str(job_dir)


def test_stages_validate_test_predict_with_a_datamodule(app):
    ok(sweep_in(app, "stages=[validate,test,predict]", "use_datamodule=true", "module.lr=0.3"))
    for stage in ("validate", "test", "predict"):
        seen = assert_ranks_agree(app / "sweep" / "0", stage)
        assert {r["datamodule"] for r in seen.values()} == {"Shapes"}
        # every rank evaluates rank 0's weights, though each built its own module
        assert seen[0]["weight_sum"] == seen[1]["weight_sum"]


def test_fit_then_test_on_one_trainer_evaluates_rank0_weights(app):
    ok(sweep_in(app, "stages=[fit,test]"))
    fit, tested = records(app / "sweep" / "0", "fit"), assert_ranks_agree(app / "sweep" / "0", "test")
    assert tested[0]["weight_sum"] == tested[1]["weight_sum"] == fit[0]["weight_sum"]
    assert (app / "sweep" / "0" / "rank_1.log").read_text().count("GLOBAL_RANK: 1") == 2  # one child per stage


# --------------------------------------------------------------------------- end to end: HydraFSDP


def test_fsdp_sweep_shards_parameters_on_cpu(app):
    proc = ok(sweep_in(app, "module.lr=0.1,0.2", strategy="fsdp"))
    for job, lr in ((0, 0.1), (1, 0.2)):
        seen = assert_ranks_agree(app / "sweep" / str(job))
        total = seen[0]["params_total"]
        held = [seen[r]["params_held"] for r in (0, 1)]
        assert sum(held) == total and all(abs(h - total / 2) <= 1 for h in held), (held, total)
        assert seen[0]["strategy"] == "hydra_fsdp.HydraFSDP" and seen[0]["lr"] == lr
    print(f"2 jobs x 2 ranks, HydraFSDP: {proc.seconds:.1f} s")


def test_fsdp_checkpoint_saves_and_loads_on_cpu(app):
    ok(
        sweep_in(
            app,
            "trainer.enable_checkpointing=true",
            "trainer.callbacks=[${keep_last}]",
            "stages=[fit,test:fresh:last,validate:fresh:best]",
            strategy="fsdp",
        )
    )
    job = app / "sweep" / "0"
    fit = records(job, "fit")
    checkpoints = {p.name for p in (job / "checkpoints").iterdir()}
    assert "last.ckpt" in checkpoints and len(checkpoints) == 2, checkpoints
    for stage in ("test", "validate"):
        seen = assert_ranks_agree(job, stage)
        # the checkpoint holds the trained weights; every rank loaded its shard of them
        assert seen[0]["weight_sum"] == pytest.approx(fit[0]["weight_sum"], rel=1e-6)
        assert seen[0]["local_weight_sum"] == pytest.approx(fit[0]["local_weight_sum"], rel=1e-6)
    # "best" was resolved on rank 0 to a real file, and that is what the children were given
    plan = hydra_fsdp.OmegaConf.load(job / ".hydra" / "rank_plan.yaml")
    assert plan.stage == "validate" and Path(plan.ckpt_path).is_file() and Path(plan.ckpt_path).is_absolute()


def test_fsdp_second_stage_on_a_used_module_fails_fast_naming_ckpt_path(app):
    proc = sweep_in(app, "stages=[fit,test]", strategy="fsdp")
    assert proc.returncode != 0
    assert "RankLaunchError" in proc.stderr and "ckpt_path" in proc.stderr
    assert assert_ranks_agree(app / "sweep" / "0", "fit")
    assert not records(app / "sweep" / "0", "test")
    # one child, for fit; none was started for the refused test stage
    assert (app / "sweep" / "0" / "rank_1.log").read_text().count("GLOBAL_RANK: 1") == 1


# --------------------------------------------------------------------------- where targets live


def test_hydra_zen_launch_multirun_from_python(tmp_path, monkeypatch):
    monkeypatch.setenv(hydra_fsdp.LAUNCH_DELAY_ENV, "0")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "lzapp.py").write_text(APP.replace('os.environ.get("APP_STRATEGY", "ddp")', '"ddp"'))
    (tmp_path / "shapes.py").write_text(SHAPES)
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


def test_copied_into_a_user_package(app):
    third_party = app / "myproj" / "third_party"
    third_party.mkdir(parents=True)
    for package in (app / "myproj", third_party):
        (package / "__init__.py").write_text("")
    (third_party / "hydra_fsdp.py").write_text(Path(hydra_fsdp.__file__).read_text())
    target = "myproj.third_party.hydra_fsdp.HydraFSDP"
    ok(run_app(app, "hydra.sweep.dir=sweep", "module.lr=0.1", f"trainer.strategy._target_={target}"))
    seen = assert_ranks_agree(app / "sweep" / "0")
    assert seen[1]["strategy"] == target
    plan = hydra_fsdp.OmegaConf.load(app / "sweep" / "0" / ".hydra" / "rank_plan.yaml")
    assert plan.config.trainer.strategy._target_ == target


# --------------------------------------------------------------------------- bad input, end to end


def test_bad_input_fails_fast_and_leaves_no_process(app):
    proc = sweep_in(app, "hydra.output_subdir=null", "module.lr=0.1,0.2", timeout=120)
    assert proc.returncode != 0
    assert "hydra.output_subdir is null" in proc.stderr
    for job in ("0", "1"):
        assert not (app / "sweep" / job / "rank_1.log").exists()
    assert proc.seconds < 60


# --------------------------------------------------------------------------- faults: one job fails, the sweep goes on

FAULT_BOUND = 60  # seconds within which a failed job must have ended and left nothing running


def assert_failed_job_then_healthy_job(app, proc, failed_rank, *, expect_in_error):
    """Job 0 failed with an error that names the rank; job 1 trained on every rank; nothing left."""
    assert proc.returncode != 0, "Hydra exits non-zero when a job of the sweep failed"
    for text in expect_in_error:
        assert text in proc.stderr, f"{text!r} not in the sweep's error output:\n{proc.stderr[-4000:]}"
    assert not records(app / "sweep" / "0"), "the failed job must not have finished on any rank"
    assert_ranks_agree(app / "sweep" / "1")
    for job in ("0", "1"):
        for rank, pid in started_pids(app / "sweep" / job).items():
            assert not alive(pid), f"job {job} rank {rank} (pid {pid}) is still running"
    # the failed job left nothing behind for the next one
    start = json.loads((app / "sweep" / "1" / "started" / "rank0.json").read_text())
    assert start["env"] == {"LOCAL_RANK": None, "MASTER_PORT": None, "WORLD_SIZE": None, "NODE_RANK": None}
    assert start["process_group"] is False
    first = json.loads((app / "sweep" / "0" / "started" / "rank0.json").read_text())
    assert start["threads"] == first["threads"], "no thread of job 0 may outlive it"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("how", ["train_raise", "train_kill"])
def test_child_rank_failure_fails_its_job_not_the_sweep(app, strategy, how):
    proc = sweep_in(app, "module.lr=0.1,0.2", "module.fail_rank=1", f"module.fail_how={how}", strategy=strategy)
    log = app / "sweep" / "0" / "rank_1.log"
    code = "exit code 1" if how == "train_raise" else "exit code -9 (killed by SIGKILL)"
    expected = ["Child rank 1 failed", code, str(log)]
    if how == "train_raise":
        expected.append("ValueError: injected failure on rank 1")  # the child's own traceback, quoted
    assert_failed_job_then_healthy_job(app, proc, 1, expect_in_error=expected)
    print(f"{strategy} {how}: sweep of 2 jobs took {proc.seconds:.1f} s")


def test_child_rank_failure_while_starting_fails_fast(app):
    proc = sweep_in(app, "module.lr=0.1,0.2", "module.fail_rank=1", "module.fail_how=init_raise")
    assert_failed_job_then_healthy_job(
        app, proc, 1, expect_in_error=["Child rank 1 failed", "exit code 1", "injected failure on rank 1"]
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rank0_failure_ends_its_children(app, strategy):
    proc = sweep_in(app, "module.lr=0.1,0.2", "module.fail_rank=0", "module.fail_how=train_raise", strategy=strategy)
    assert proc.returncode != 0
    assert "ValueError: injected failure on rank 0" in proc.stderr
    assert not records(app / "sweep" / "0")
    assert_ranks_agree(app / "sweep" / "1")
    for job in ("0", "1"):
        for rank, pid in started_pids(app / "sweep" / job).items():
            assert not alive(pid), f"job {job} rank {rank} (pid {pid}) is still running"


def test_child_hanging_before_rendezvous_is_bounded_by_rank_timeout(app):
    proc = sweep_in(
        app,
        "module.lr=0.1,0.2",
        "module.fail_rank=1",
        "module.fail_how=init_hang",
        "trainer.strategy.rank_timeout=8",
    )
    assert_failed_job_then_healthy_job(
        app, proc, 1, expect_in_error=["[1] did not reach the process group within 8 s", "rank_timeout"]
    )


def test_child_hanging_in_training_is_bounded_by_the_process_group_timeout(app):
    proc = sweep_in(
        app,
        "module.lr=0.1,0.2",
        "module.fail_rank=1",
        "module.fail_how=train_hang",
        "+trainer.strategy.timeout={_target_:datetime.timedelta,seconds:10}",
    )
    log = app / "sweep" / "0" / "rank_1.log"
    assert_failed_job_then_healthy_job(
        app,
        proc,
        1,
        expect_in_error=["Timed out", "child ranks were still running", "rank 1 (pid", f"its log is {log}"],
    )
    # the log shows where the hung rank stood: its stack, dumped before it was ended
    assert "in _maybe_fail" in log.read_text()


def start_sweep(app_dir, *overrides, env=None):
    full_env = dict(os.environ, MUSHIN_DDP_LAUNCH_DELAY="0", APP_STRATEGY="ddp")
    full_env.pop("PYTHONPATH", None)
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "app.py", "-m", "hydra.sweep.dir=sweep", *overrides],
        cwd=app_dir,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: what a terminal's Ctrl-C reaches
    )


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["SIGTERM to the sweep", "Ctrl-C", "SIGKILL to the sweep"])
def test_stopping_the_sweep_ends_every_rank(app, how):
    sweep = start_sweep(app, "module.lr=0.1,0.2", env={"APP_SLOW_STEPS": "1"})
    job = app / "sweep" / "0"
    try:
        wait_for(lambda: len(started_pids(job)) == 2, SWEEP_TIMEOUT, "both ranks of job 0 to start")
        time.sleep(3)  # into training
        stopped = time.monotonic()
        if how == "Ctrl-C":
            os.killpg(sweep.pid, signal.SIGINT)
        else:
            sweep.send_signal(signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGKILL)
        sweep.wait(timeout=FAULT_BOUND)
        took = time.monotonic() - stopped
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    assert sweep.returncode != 0
    pids = started_pids(job)
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), 10, f"every rank of job 0 {pids} to end")
    assert not (app / "sweep" / "1").exists(), "a stopped sweep must not start its next job"
    print(f"{how}: the sweep ended {took:.1f} s after the signal, rank 1 with it")


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
    apps = []
    for name in ("a", "b"):
        app_dir = tmp_path / name
        app_dir.mkdir()
        (app_dir / "app.py").write_text(APP)
        (app_dir / "shapes.py").write_text(SHAPES)
        apps.append(app_dir)
    lrs = ",".join(str(i / 100) for i in range(1, 9))
    started = time.monotonic()
    sweeps = [start_sweep(app_dir, f"module.lr={lrs}") for app_dir in apps]
    outputs = [sweep.communicate(timeout=900)[0].decode() for sweep in sweeps]
    for sweep, output in zip(sweeps, outputs):
        assert sweep.returncode == 0, output[-4000:]
    ports = set()
    for app_dir in apps:
        for job in range(8):
            seen = assert_ranks_agree(app_dir / "sweep" / str(job))
            ports.add(seen[1]["master_port"])
    assert len(ports) == 16, "no two jobs of the two sweeps may share a port"
    print(f"2 concurrent sweeps of 8 jobs x 2 ranks: {time.monotonic() - started:.1f} s")


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
