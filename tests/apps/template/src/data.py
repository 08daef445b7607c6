import torch
from lightning import LightningDataModule


class ShapesDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def _loader(self, seed: int) -> torch.utils.data.DataLoader:
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(seed))
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    def train_dataloader(self):
        return self._loader(0)

    def val_dataloader(self):
        return self._loader(1)

    def test_dataloader(self):
        return self._loader(2)

    def predict_dataloader(self):
        return self._loader(3)
