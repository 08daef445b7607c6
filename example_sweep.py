"""A Hydra sweep of 2 jobs x 2 ranks with HydraFSDP (or HydraDDP, HydraModelParallel), made with hydra-zen.

    python example_sweep.py -m                                   # HydraFSDP, module.lr=0.01,0.05
    python example_sweep.py -m trainer/strategy=ddp              # the same sweep with HydraDDP
    python example_sweep.py -m trainer/strategy=model_parallel   # with FSDP2 (Lightning, torch >= 2.4)
    python example_sweep.py -m trainer/strategy=ddp,fsdp,model_parallel   # all three, 6 jobs

It trains on 2 GPUs when there are 2, else on the CPU with 2 processes (gloo). At the end of each job,
rank 0 prints a line for every rank of the job: its process, the parameters it holds and its loss.
The model is seeded (``seed``), so the three strategies end each lr at the same loss: sharding the
parameters (FSDP, FSDP2) trains the same model as keeping a full copy on every rank (DDP).
"""

import os

import pytorch_lightning as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra_zen import builds, make_config, store, zen

from hydra_fsdp import HydraDDP, HydraFSDP, HydraModelParallel


class Regressor(pl.LightningModule):
    """Defined in the launching script: child ranks still find it as __main__.Regressor."""

    def __init__(self, lr: float = 0.01, width: int = 256):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.total_parameters = sum(p.numel() for p in self.net.parameters())

    def configure_model(self):
        """HydraModelParallel's: shard each Linear and the whole with FSDP2, once (Lightning calls this before
        every stage). Under the other strategies there is no device mesh, and nothing to do here."""
        if getattr(self, "device_mesh", None) is None:  # not HydraModelParallel, or no Trainer (a load)
            return
        try:
            from torch.distributed.fsdp import FSDPModule, fully_shard
        except ImportError:  # torch 2.4, 2.5
            from torch.distributed._composable.fsdp import FSDPModule, fully_shard

        if not isinstance(self.net, FSDPModule):
            for layer in (self.net[0], self.net[2], self.net):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=32)

    def on_train_end(self):
        """Rank 0 prints every rank's report: a child rank's own console is its log (rank_1.log)."""
        held = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in self.trainer.model.parameters())
        loss = self.trainer.callback_metrics["train_loss"]
        mine = torch.tensor([os.getpid(), held, loss], dtype=torch.float64, device=self.device)
        every_rank = self.all_gather(mine)  # one row per rank, on every rank
        if self.global_rank != 0:
            return
        job = f"job {HydraConfig.get().job.num}: lr={self.lr}, {type(self.trainer.strategy).__name__},"
        for rank, (pid, held, loss) in enumerate(every_rank.tolist()):
            print(
                f"{job} rank {rank}/{self.trainer.world_size} (pid {pid:.0f}) holds {held:.0f}"
                f" of {self.total_parameters} parameters, loss {loss:.4f}",
                flush=True,
            )


two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
Trainer = builds(
    pl.Trainer,
    accelerator="gpu" if two_gpus else "cpu",
    devices=2,
    max_epochs=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    default_root_dir="${hydra:runtime.output_dir}",
    populate_full_signature=True,
)
store(builds(HydraFSDP), group="trainer/strategy", name="fsdp")
store(builds(HydraDDP), group="trainer/strategy", name="ddp")
store(  # FSDP2 over both ranks: the default mesh (1 x 2) would shard no data
    builds(HydraModelParallel, data_parallel_size=2, tensor_parallel_size=1),
    group="trainer/strategy",
    name="model_parallel",
)
store(
    make_config(
        hydra_defaults=["_self_", {"trainer/strategy": "fsdp"}],
        seed=0,
        trainer=Trainer,
        module=builds(Regressor, populate_full_signature=True),
        hydra={"sweeper": {"params": {"module.lr": "0.01,0.05"}}},
    ),
    name="example",
)


def seed(config) -> None:
    """zen's pre_call, before the Trainer and the module are built, on every rank: the same initial weights.
    A top-level function, not a lambda: child ranks find the task function, pre_call included, by name."""
    pl.seed_everything(config.seed)


def train(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    trainer.fit(module)


if __name__ == "__main__":
    store.add_to_hydra_store()
    zen(train, pre_call=seed).hydra_main(config_name="example", config_path=None, version_base="1.3")
