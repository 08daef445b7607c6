"""The no-Hydra baseline: one plain script, Lightning's Trainer(strategy="ddp"), one run per call.

    python bench/plain.py --devices 2 --trial 0

Lightning starts rank 1 by re-running this script. The LightningModule is the same as
app.Bench (kept identical by hand: importing app.py would import Hydra and hydra_zen, which a
plain script does not pay for). Records go to $BENCH_RECORD_DIR like the app's.
"""

import argparse

import pytorch_lightning as pl
import torch
from probe import memory_kib, record

record("app_loaded", module=__name__)


class Bench(pl.LightningModule):
    """Identical to app.Bench."""

    def __init__(self, width=32, depth=2, batch=8, steps=4, lr=1e-3, trial=0):
        super().__init__()
        record("init", job=trial, **memory_kib())
        self.lr, self.width, self.batch, self.steps, self.trial = lr, width, batch, steps, trial
        torch.manual_seed(trial)
        layers = []
        for i in range(depth):
            layers += [torch.nn.Linear(width, width)] + ([torch.nn.ReLU()] if i < depth - 1 else [])
        self.net = torch.nn.Sequential(*layers)
        self.params_total = sum(p.numel() for p in self.net.parameters())

    def setup(self, stage):
        record(
            "setup",
            stage=stage,
            job=self.trial,
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

    def on_train_end(self):
        record(
            "fit_end",
            job=self.trial,
            global_rank=self.global_rank,
            world=self.trainer.world_size,
            strategy=type(self.trainer.strategy).__name__,
            params_held=sum(p.numel() for p in self.trainer.model.parameters()),
            params_total=self.params_total,
            steps_done=self.trainer.global_step,
            **memory_kib(),
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trial", type=int, default=0)
    args = parser.parse_args()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_epochs=1,
        limit_train_batches=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = Bench(width=args.width, depth=args.depth, batch=args.batch, steps=args.steps, trial=args.trial)
    trainer.fit(module)


if __name__ == "__main__":
    main()
