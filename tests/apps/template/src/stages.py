"""Every stage after fit in one job, each loading a checkpoint fit wrote: validate the best,
test one by its path (the second epoch's: with three epochs, neither the last nor the first, which is
the best where the checkpoint callback's mode is max), predict with the last. Each loads other weights
than the stage before it left: a load that loaded nothing shows. (The template's train.py tests the
best only.)"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

ROOT = next(p for p in Path(__file__).resolve().parents if (p / ".project-root").exists())
sys.path.insert(0, str(ROOT))
os.environ["PROJECT_ROOT"] = str(ROOT)

from src.utils import instantiate_callbacks, instantiate_loggers


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    logger = instantiate_loggers(cfg.get("logger"))
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=logger)
    trainer.fit(model=model, datamodule=datamodule)
    second = sorted(Path(cfg.paths.output_dir, "checkpoints").glob("epoch_*"))[1]
    trainer.validate(model=model, datamodule=datamodule, ckpt_path="best")
    trainer.test(model=model, datamodule=datamodule, ckpt_path=str(second))
    trainer.predict(model=model, datamodule=datamodule, ckpt_path="last")


if __name__ == "__main__":
    main()
