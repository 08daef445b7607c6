"""A tiny LightningModule that records, per rank, what that rank ran (for the tests to compare)."""

import json
import os
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from lightning import LightningModule
from lightning.pytorch import strategies

from src.shards import shards_of

_SHARDING = (strategies.FSDPStrategy, getattr(strategies, "ModelParallelStrategy", strategies.FSDPStrategy))


class _RecordingModule(LightningModule):
    def forward(self, x):
        return self.net(x)

    def configure_model(self):
        """trainer=model_parallel's FSDP2 over the mesh, once (Lightning calls this before every stage)."""
        if getattr(self, "device_mesh", None) is None:  # no ModelParallelStrategy (or no Trainer: a load)
            return
        try:
            from torch.distributed.fsdp import FSDPModule, fully_shard
        except ImportError:  # torch 2.4, 2.5
            from torch.distributed._composable.fsdp import FSDPModule, fully_shard

        if not isinstance(self.net, FSDPModule):
            for layer in (self.net[0], self.net[2], self.net):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def on_train_start(self):  # after a resumed fit restored its checkpoint
        self._record("train_start")

    def _loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train/loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def on_train_end(self):
        self._record("fit")

    def on_test_end(self):
        self._record("test")

    def on_validation_end(self):
        if self.trainer.state.fn == "validate":  # not fit's validation loop
            self._record("validate")

    def on_predict_end(self):
        self._record("predict")

    def _record(self, stage):
        held = [
            getattr(p, "to_local", lambda p=p: p)().detach().double() for p in self.trainer.model.parameters()
        ]
        # on the module's device: NCCL reduces CUDA tensors only
        local_sum = torch.tensor(float(sum(p.sum() for p in held)), dtype=torch.float64, device=self.device)
        full_sum = local_sum.clone()
        torch.distributed.all_reduce(full_sum)
        trainer = self.trainer
        seen = {
            "stage": stage,
            "rank": trainer.global_rank,
            "world": trainer.world_size,
            "pid": os.getpid(),
            "lr": self.hparams.lr,
            "callbacks": sorted(type(c).__name__ for c in trainer.callbacks),
            "loggers": sorted(type(lg).__name__ for lg in trainer.loggers),
            "ckpt_path": trainer.ckpt_path,
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "strategy": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__qualname__}",
            "output_dir": HydraConfig.get().runtime.output_dir,
            "params_held": sum(p.numel() for p in held),
            "local_weight_sum": float(local_sum),
            "weight_sum": float(full_sum) if isinstance(trainer.strategy, _SHARDING) else float(local_sum),
            # a rank holding the full weights (not sharded): what each rank of a sharding strategy should
            # hold of them, for the tests to compare a sharded job's ranks with (local_weight_sum)
            "shards_should_hold": None
            if isinstance(trainer.strategy, _SHARDING)
            else shards_of(self.net, trainer.world_size),
        }
        out = Path(seen["output_dir"], "seen")
        out.mkdir(exist_ok=True)
        (out / f"{stage}_rank{trainer.global_rank}.json").write_text(json.dumps(seen))


class TinyNet(torch.nn.Sequential):
    """The template's ``net``: a plain nn.Module its config builds and hands to the LightningModule."""

    def __init__(self, width: int = 32) -> None:
        super().__init__(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))


class TinyLitModule(_RecordingModule):
    def __init__(self, lr: float = 0.1, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyNet(width)


class NetLitModule(_RecordingModule):
    """lightning-hydra-template's MNISTLitModule in shape: ``net`` comes from the config and is kept
    in the hyperparameters, which pickles the nn.Module into every checkpoint."""

    def __init__(self, net: torch.nn.Module, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net

    def configure_optimizers(self):  # the template's Adam: a state per parameter, unlike plain SGD
        return torch.optim.Adam(self.trainer.model.parameters(), lr=self.hparams.lr / 100)
