"""The Hydra app the benchmarks sweep: a stack of Linear layers, configured with hydra-zen.

    python bench/app.py -m module.trial=range(0,4)                              # HydraDDP, 4 jobs x 2 ranks
    python bench/app.py -m trainer/strategy=stock_ddp module.trial=range(0,4)   # Lightning's strategy="ddp"
    python bench/app.py -m trainer/strategy=hydra_fsdp module.width=2048 module.depth=12

``trainer/strategy`` is ``hydra_ddp`` (default), ``hydra_fsdp`` (auto-wrapped per Linear) or
``stock_ddp`` (the string "ddp", as a user would write ``Trainer(strategy="ddp")``). Every rank
appends what it measured to ``$BENCH_RECORD_DIR/<pid>.jsonl`` (see probe.py): when this script
was loaded, when the process group was up, parameters held and memory at the end of fit.
The LightningModule is defined here, so HydraDDP's child ranks find it as ``__main__.Bench``.
"""

import pytorch_lightning as pl
import torch
from hydra_zen import builds, make_config, store, zen
from probe import memory_kib, record

from hydra_fsdp import HydraDDP, HydraFSDP

record("app_loaded", module=__name__)


def _job_num() -> int:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return 0
    num = OmegaConf.select(HydraConfig.get(), "job.num", default=None)  # "???" outside -m: None
    return 0 if num is None else int(num)


class Bench(pl.LightningModule):
    """``depth`` Linear(width, width) layers with ReLUs between, Adam, ``steps`` batches of noise.

    Parameters: depth * (width**2 + width); width=2048: depth 3 ~ 12.6M, 12 ~ 50.4M, 24 ~ 100.7M.
    """

    def __init__(
        self,
        width: int = 32,
        depth: int = 2,
        batch: int = 8,
        steps: int = 4,
        lr: float = 1e-3,
        trial: int = 0,
    ):
        super().__init__()
        record("init", job=_job_num(), **memory_kib())  # the baseline: before the weights exist
        self.lr, self.width, self.batch, self.steps = lr, width, batch, steps
        torch.manual_seed(trial)
        layers = []
        for i in range(depth):
            layers += [torch.nn.Linear(width, width)] + ([torch.nn.ReLU()] if i < depth - 1 else [])
        self.net = torch.nn.Sequential(*layers)
        self.params_total = sum(p.numel() for p in self.net.parameters())

    def setup(self, stage: str) -> None:
        # Lightning calls this after the strategy joined the process group (and a barrier)
        record(
            "setup",
            stage=stage,
            job=_job_num(),
            global_rank=self.global_rank,
            world=self.trainer.world_size,
            process_group=torch.distributed.is_available() and torch.distributed.is_initialized(),
            strategy=type(self.trainer.strategy).__name__,
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return torch.nn.functional.mse_loss(self(x), x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        x = torch.randn(self.steps * self.batch * 8, self.width, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=self.batch)

    def on_train_end(self) -> None:
        record(
            "fit_end",
            job=_job_num(),
            global_rank=self.global_rank,
            world=self.trainer.world_size,
            strategy=type(self.trainer.strategy).__name__,
            params_held=sum(p.numel() for p in self.trainer.model.parameters()),
            params_total=self.params_total,
            steps_done=self.trainer.global_step,
            **memory_kib(),
        )


Trainer = builds(
    pl.Trainer,
    accelerator="cpu",
    devices=2,
    max_epochs=1,
    limit_train_batches="${module.steps}",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    default_root_dir="${hydra:runtime.output_dir}",
    populate_full_signature=True,
)
store(builds(HydraDDP), group="trainer/strategy", name="hydra_ddp")
store(builds(HydraFSDP, auto_wrap_policy={torch.nn.Linear}), group="trainer/strategy", name="hydra_fsdp")
store(builds(str, "ddp"), group="trainer/strategy", name="stock_ddp")  # instantiates to the string "ddp"
store(
    make_config(
        hydra_defaults=["_self_", {"trainer/strategy": "hydra_ddp"}],
        trainer=Trainer,
        module=builds(Bench, populate_full_signature=True),
    ),
    name="bench",
)


def train(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    trainer.fit(module)


if __name__ == "__main__":
    store.add_to_hydra_store()
    zen(train).hydra_main(config_name="bench", config_path=None, version_base="1.3")
