"""The app bench/checkpoint_memory.py runs: write a full checkpoint of a wide model, or test one.

    python bench/ckpt_app.py write=true ckpt=/tmp/w.ckpt                 # fit 1 step, save
    python bench/ckpt_app.py ckpt=/tmp/w.ckpt strategy=lightning_lazy    # test(ckpt_path=...)

``keep_net=true`` builds the module the lightning-hydra-template way: its ``net`` passed in and
kept in the hyperparameters, so the checkpoint pickles the nn.Module. ``strategy`` is
``hydra_fsdp`` (HydraFSDP's own load) or ``lightning_lazy`` (the same strategy, loading through
Lightning's FSDPStrategy.load_checkpoint and its lazy loader).
"""

from dataclasses import dataclass

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.config_store import ConfigStore

import hydra_fsdp


@dataclass
class Config:
    ckpt: str | None = None  # test without one: the baseline
    write: bool = False
    keep_net: bool = False
    strategy: str = "hydra_fsdp"
    width: int = 2048
    depth: int = 12  # 12 x Linear(2048, 2048): 50.4M parameters


ConfigStore.instance().store(name="ckpt_bench", node=Config)


def wide_net(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))


class _Steps(pl.LightningModule):
    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).square().mean()

    def test_step(self, batch, batch_idx):
        self.log("loss", self(batch[0]).square().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


class Wide(_Steps):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = wide_net(width, depth)


class WideNet(_Steps):
    """The template's shape: ``net`` from outside, kept in the hyperparameters."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net


class LightningLazyLoad(hydra_fsdp.lightning.HydraFSDP):
    """HydraFSDP, loading a checkpoint the way Lightning's own FSDPStrategy does (lazily)."""

    def load_checkpoint(self, checkpoint_path, **kwargs):
        return pl.strategies.FSDPStrategy.load_checkpoint(self, checkpoint_path, **kwargs)


STRATEGIES = {"hydra_fsdp": hydra_fsdp.lightning.HydraFSDP, "lightning_lazy": LightningLazyLoad}


@hydra.main(version_base="1.3", config_path=None, config_name="ckpt_bench")
def main(cfg: Config) -> None:
    module = WideNet(wide_net(cfg.width, cfg.depth)) if cfg.keep_net else Wide(cfg.width, cfg.depth)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, cfg.width)), batch_size=8
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=STRATEGIES[cfg.strategy](),
        max_steps=1,
        limit_test_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if cfg.write:
        trainer.fit(module, train_dataloaders=data)
        trainer.save_checkpoint(cfg.ckpt)
    else:
        trainer.test(module, dataloaders=data, ckpt_path=cfg.ckpt)


if __name__ == "__main__":
    main()
