"""Unit tests: a mocked ``subprocess.Popen`` (and sleep) pins what a launch runs and refuses."""

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

import hydra_fsdp
from hydra_fsdp import ChildRankError, HydraDDP, HydraFSDP, RankLaunchError


class _StopAfterSpawn(ChildRankError):
    """Raised where rank 0 would wait for its children to check in: the launch ends there."""


def launch_with_mocked_children(
    tmp_path, strategy, devices=3, env=None, fit_kwargs=None, config=None, overrides=()
):
    """Run one Hydra job (in this process) whose fit() spawns children into a mocked Popen.

    Returns (mocked Popen, mocked sleep, job dir, the job's error). The children never check in:
    the launch is stopped there, which also shows the launch's cleanup.
    """
    import pytorch_lightning as pl
    from hydra_zen import builds, launch, make_config

    if config is None:
        config = make_config(
            trainer=builds(
                pl.Trainer, accelerator="cpu", devices=devices, strategy=builds(strategy), logger=False
            ),
            module=builds(torch.nn.Linear, 2, 2),
        )

    def task(cfg):
        from hydra.utils import instantiate

        trainer = instantiate(cfg.trainer)
        trainer.fit(_fit_module(), **(fit_kwargs or {}))

    with (
        mock.patch.dict(os.environ, env or {}),
        mock.patch.object(hydra_fsdp.subprocess, "Popen") as popen,
        mock.patch.object(hydra_fsdp.time, "sleep") as sleep,
        mock.patch.object(hydra_fsdp._ChildRanks, "wait_until_checked_in", side_effect=_StopAfterSpawn),
    ):
        popen.return_value.poll.return_value = None
        popen.return_value.pid = 4242
        try:
            launch(
                config, task, overrides=[f"hydra.run.dir={tmp_path / 'job'}", *overrides], version_base="1.3"
            )
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
        assert call.kwargs["stdin"] == subprocess.DEVNULL  # cold: one stage, then it exits
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
    popen, _, _, error = launch_with_mocked_children(
        tmp_path, HydraFSDP, overrides=["hydra.output_subdir=null"]
    )
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
        trainer=builds(
            pl.Trainer, accelerator="cpu", devices=2, strategy=builds(HydraDDP, module_key="model")
        ),
        model=builds(torch.nn.Linear, 2, 2),
    )
    popen, _, job_dir, error = launch_with_mocked_children(tmp_path, HydraDDP, config=config)
    assert isinstance(error, _StopAfterSpawn)
    assert hydra_fsdp.OmegaConf.load(job_dir / ".hydra" / "rank_plan.yaml").module_key == "model"


def test_dataloaders_passed_directly_are_refused(tmp_path):
    loader = torch.utils.data.DataLoader(torch.randn(4, 2))
    popen, _, _, error = launch_with_mocked_children(
        tmp_path, HydraDDP, fit_kwargs={"train_dataloaders": loader}
    )
    assert isinstance(error, RankLaunchError) and "train_dataloaders" in str(error)
    popen.assert_not_called()


def test_outside_a_hydra_job_is_a_clear_error():
    import pytorch_lightning as pl

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HydraDDP(), logger=False)
    with (
        mock.patch.object(hydra_fsdp.subprocess, "Popen") as popen,
        pytest.raises(RankLaunchError, match="no"),
    ):
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
