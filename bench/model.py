"""The LightningModule both bench apps train: app.py (Hydra) and plain.py (no Hydra).

It imports no Hydra, so that the plain script does not pay for it.
"""

import pytorch_lightning as pl
import torch
from probe import memory_kib, record


class Bench(pl.LightningModule):
    """``depth`` Linear(width, width) layers with ReLUs between, Adam, ``steps`` batches of noise.

    Parameters: depth * (width**2 + width); width=2048: depth 3 ~ 12.6M, 12 ~ 50.4M, 24 ~ 100.7M.
    Records carry ``job()``: the trial here, the Hydra job number in app.py.
    """

    def __init__(self, width=32, depth=2, batch=8, steps=4, lr=1e-3, trial=0):
        super().__init__()
        self.lr, self.width, self.batch, self.steps, self.trial = lr, width, batch, steps, trial
        record("init", job=self.job(), **memory_kib())  # the baseline: before the weights exist
        torch.manual_seed(trial)
        layers = []
        for i in range(depth):
            layers += [torch.nn.Linear(width, width)] + ([torch.nn.ReLU()] if i < depth - 1 else [])
        self.net = torch.nn.Sequential(*layers)
        self.params_total = sum(p.numel() for p in self.net.parameters())

    def job(self) -> int:
        return self.trial

    def setup(self, stage):
        # Lightning calls this after the strategy joined the process group (and a barrier)
        record(
            "setup",
            stage=stage,
            job=self.job(),
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
            job=self.job(),
            global_rank=self.global_rank,
            world=self.trainer.world_size,
            strategy=type(self.trainer.strategy).__name__,
            params_held=sum(p.numel() for p in self.trainer.model.parameters()),
            params_total=self.params_total,
            steps_done=self.trainer.global_step,
            **memory_kib(),
        )
