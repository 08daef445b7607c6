"""A datamodule in a module next to the launching script: child ranks import it without PYTHONPATH.

The app runs on the Lightning namespace APP_LIGHTNING names (default ``pytorch_lightning``).
"""

import importlib
import os

import torch

pl = importlib.import_module(os.environ.get("APP_LIGHTNING", "pytorch_lightning"))


class Shapes(pl.LightningDataModule):
    def _data(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(48, 8, generator=g)
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
        )

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _data
