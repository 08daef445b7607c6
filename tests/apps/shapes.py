"""What the apps share, in a module next to the launching script (child ranks import it without
PYTHONPATH): a datamodule and its data, and the Trainer settings of a quiet CPU run (also bench/app.py's).

The app runs on the Lightning namespace APP_LIGHTNING names (default ``pytorch_lightning``).
"""

import importlib
import os
from pathlib import Path

import torch

pl = importlib.import_module(os.environ.get("APP_LIGHTNING", "pytorch_lightning"))

# 2 CPU ranks, one epoch, nothing written or printed that the run does not ask for
QUIET_CPU_TRAINER = {
    "accelerator": "cpu",
    "devices": 2,
    "max_epochs": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "default_root_dir": "${hydra:runtime.output_dir}",
}


def regression_data(seed, samples):
    """``samples`` random inputs of 8 features and their sum to learn, in batches of 8."""
    x = torch.randn(samples, 8, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )


class Shapes(pl.LightningDataModule):
    def _data(self):
        return regression_data(seed=1, samples=48)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _data


def live_descendants():
    """Every live process below this one (a zombie is gone: it holds nothing), {pid: command line}."""
    parent_of, cmdline = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[0] != "Z":
                parent_of[int(entry.name)], cmdline[int(entry.name)] = int(fields[1]), command.strip()
    found, frontier = {}, [os.getpid()]
    while frontier:
        frontier = [pid for pid, parent in parent_of.items() if parent in frontier and pid not in found]
        found.update((pid, cmdline[pid]) for pid in frontier)
    return found
