# ruff: noqa: UP006, UP035, UP045 - typing.List/Dict/Optional, as Hydra's structured-config tutorials write them
"""The config shapes of Hydra's structured-config tutorials, and hydra-zen's, swept with HydraDDP/HydraFSDP:
every rank writes to <job dir>/seen/rank<N>.json what its task function received (types, flags,
values) and which branch it took.

APP_SHAPE picks the primary config: ``dataclass`` (a dataclass stored as the ConfigStore node named
``config``, as in Lightning #15545), ``yaml`` (configs/train.yaml, whose defaults list names that
dataclass as its schema) or ``zen`` (hydra-zen ``make_config``/``builds`` with
``populate_full_signature``, run through ``zen``). APP_RESOLVER registers a ``run_id`` resolver
without ``use_cache``: ``import`` at import time, ``main`` only under ``if __name__ == "__main__":``.
"""

import enum
import inspect
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import hydra
import pytorch_lightning as pl
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra_zen import builds, make_config, zen
from omegaconf import DictConfig, OmegaConf

from hydra_fsdp import HydraDDP, HydraFSDP

SHAPE = os.environ.get("APP_SHAPE", "dataclass")
STRATEGY = {"ddp": HydraDDP, "fsdp": HydraFSDP}[os.environ.get("APP_STRATEGY", "ddp")]
# omegaconf 2.4 deprecates register_new_resolver for register_resolver (2.3's register_resolver is the
# legacy one, of other semantics): either must work
OMEGACONF_2_4 = "use_cache" in inspect.signature(OmegaConf.register_resolver).parameters
register_resolver = OmegaConf.register_resolver if OMEGACONF_2_4 else OmegaConf.register_new_resolver
if os.environ.get("APP_RESOLVER") == "import":
    register_resolver("run_id", lambda: uuid.uuid4().hex)


class Mode(enum.Enum):
    slow = 1
    fast = 2


@dataclass
class Optim:
    lr: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.99])


@dataclass
class Config:
    optim: Optim = field(default_factory=Optim)
    mode: Mode = Mode.slow
    seed: Optional[int] = None
    sizes: Dict[str, int] = field(default_factory=lambda: {"width": 8})
    steps: float = 2  # a float: an untyped load reads 2, an int
    run_id: str = "none"
    devices: int = 2
    kernel: Tuple[int, int] = (3, 3)  # omegaconf 2.4: a TupleConfig, to_object a tuple (2.3: a list)


class Tiny(pl.LightningModule):
    def __init__(self, width, lr):
        super().__init__()
        self.lr, self.net = lr, torch.nn.Linear(4, width)

    def training_step(self, batch, idx):
        return self.net(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)


def record(cfg, typed, lr, width, callbacks):
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    seen = Path(HydraConfig.get().runtime.output_dir, "seen")
    seen.mkdir(exist_ok=True)
    (seen / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "config type": type(typed).__qualname__,
                "node types": {key: type(value).__qualname__ for key, value in vars(typed).items()},
                "struct": OmegaConf.is_struct(cfg),
                "readonly": OmegaConf.is_readonly(cfg),
                "lr": lr,
                "width": width,
                "kernel": list(getattr(typed, "kernel", [])),
                "run_id": cfg.get("run_id"),
                "callbacks": [type(c).__qualname__ for c in callbacks],
                "job": HydraConfig.get().job.num,
                "hydra dir": (Path(HydraConfig.get().runtime.output_dir) / ".hydra").exists(),
            }
        )
    )


def train(cfg: DictConfig) -> None:
    typed = OmegaConf.to_object(cfg)
    callbacks = [pl.callbacks.Timer()] if isinstance(typed.mode, Mode) and typed.mode == Mode.slow else []
    record(cfg, typed, typed.optim.lr, typed.sizes["width"], callbacks)
    fit(cfg.devices, callbacks, typed.sizes["width"], typed.optim.lr)


def fit(devices, callbacks, width, lr):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=STRATEGY(),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(Tiny(width, lr))


# hydra-zen: the config is made at run time (dataclasses of module "types"), the task function by zen
ZenConfig = make_config(
    optim=builds(torch.optim.SGD, lr=0.1, zen_partial=True, populate_full_signature=True),
    width=8,
    devices=2,
)


def zen_fit(optim, width, devices, zen_cfg):
    record(zen_cfg, OmegaConf.to_object(zen_cfg), optim.keywords["lr"], width, [])
    fit(devices, [], width, optim.keywords["lr"])


zen_task = zen(zen_fit)  # Hydra runs the Zen object itself: children have it by reference
store = ConfigStore.instance()
store.store(name="config", node=Config)  # the name of Lightning #15545's hang
store.store(name="schema", node=Config)
store.store(name="zen", node=ZenConfig)

if __name__ == "__main__":
    if os.environ.get("APP_RESOLVER") == "main":
        register_resolver("run_id", lambda: uuid.uuid4().hex)
    name = {"dataclass": "config", "yaml": "train", "zen": "zen"}[SHAPE]
    hydra.main(config_path=str(Path(__file__).parent / "configs"), config_name=name, version_base="1.3")(
        zen_task if SHAPE == "zen" else train
    )()
