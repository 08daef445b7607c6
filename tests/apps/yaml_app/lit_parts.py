"""The model and data of the YAML app, on the Lightning namespace APP_LIGHTNING names (default
``lightning.pytorch``: the unified package's, as lightning-hydra-template's)."""

import importlib
import json
import logging
import os
import time
import warnings
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig

L = importlib.import_module(os.environ.get("APP_LIGHTNING", "lightning.pytorch"))

log = logging.getLogger(__name__)


class TinyModel(L.LightningModule):
    def __init__(self, lr: float = 0.1, fail_rank: int = -1):
        super().__init__()
        self.lr = lr
        self.fail_rank = fail_rank  # a rank that raises once it recorded its fit (a job that fails late)
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, idx):
        if idx == 0:
            warnings.warn("a warning that every rank raises")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def test_step(self, batch, idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_fit_start(self):
        self.fit_started = time.time()
        meeting = os.environ.get("APP_MEET_IN")  # a folder: the first job to train waits for a second
        if meeting and self.global_rank == 0:
            Path(meeting, str(os.getpid())).touch()
            deadline = time.time() + 60  # then it goes on alone (and the test that asked fails)
            while len(os.listdir(meeting)) < 2 and time.time() < deadline:
                time.sleep(0.05)

    def on_train_end(self):
        log.warning(f"rank {self.global_rank} of {self.trainer.world_size}: trained")
        self._record("fit")
        if self.global_rank == self.fail_rank:
            raise ValueError(f"injected failure on rank {self.global_rank}")

    def on_test_end(self):
        self._record("test")

    def _record(self, stage):
        strategy = type(self.trainer.strategy)
        seen = {
            "rank": self.global_rank,
            "world": self.trainer.world_size,
            "lr": self.lr,
            "output_dir": HydraConfig.get().runtime.output_dir,
            "strategy": f"{strategy.__module__}.{strategy.__qualname__}",
            "trainer": type(self.trainer).__module__,
            "datamodule": type(self.trainer.datamodule).__name__,
            "pid": os.getpid(),
            "weight_sum": float(sum(p.detach().sum() for p in self.parameters())),
            # what it ran on, and when: jobs at once must not share a core
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "affinity": sorted(os.sched_getaffinity(0)),
            "fit_started": getattr(self, "fit_started", None),
            "time": time.time(),
        }
        out = Path(seen["output_dir"], "seen")
        out.mkdir(exist_ok=True)
        (out / f"{stage}_rank{self.global_rank}.json").write_text(json.dumps(seen))


class ShapesData(L.LightningDataModule):
    def _loader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
        )

    train_dataloader = test_dataloader = _loader
