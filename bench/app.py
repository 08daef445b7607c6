"""The Hydra app the benchmarks sweep: a stack of Linear layers, configured with hydra-zen.

    python bench/app.py -m module.trial=range(0,4)                              # HydraDDP, 4 jobs x 2 ranks
    python bench/app.py -m trainer/strategy=stock_ddp module.trial=range(0,4)   # Lightning's strategy="ddp"
    python bench/app.py -m trainer/strategy=hydra_fsdp module.width=2048 module.depth=12

``trainer/strategy`` is ``hydra_ddp`` (default), ``hydra_fsdp`` (auto-wrapped per Linear) or
``stock_ddp`` (the string "ddp", as a user would write ``Trainer(strategy="ddp")``). Every rank
appends what it measured to ``$BENCH_RECORD_DIR/<pid>.jsonl`` (see probe.py): when this script
was loaded, when the process group was up, parameters held and memory at the end of fit.
The LightningModule (model.Bench) is subclassed here, so HydraDDP's child ranks must find it
as ``__main__.Bench``, as a user's would be.
"""

import sys
from pathlib import Path

import model
import pytorch_lightning as pl
import torch
from hydra_zen import builds, make_config, store, zen
from probe import record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "apps"))  # the tests' apps' settings
from shapes import QUIET_CPU_TRAINER

from hydra_fsdp import HydraDDP, HydraFSDP

record("app_loaded", module=__name__)


def _job_num() -> int:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return 0
    num = OmegaConf.select(HydraConfig.get(), "job.num", default=None)  # "???" outside -m: None
    return 0 if num is None else int(num)


class Bench(model.Bench):
    """model.Bench, its records numbered by the Hydra job; defined in this script on purpose."""

    def job(self) -> int:
        return _job_num()


Trainer = builds(
    pl.Trainer,
    **QUIET_CPU_TRAINER,
    limit_train_batches="${module.steps}",
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
