"""lightning-hydra-template's src/train.py, kept in its shape: callbacks and loggers from their own
config groups, a task_wrapper decorator, seed, fit, then test with the best checkpoint.

    python src/train.py -m model.lr=0.1,0.2
"""

import os
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from lightning import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

# what rootutils.setup_root(__file__, indicator=".project-root", pythonpath=True) does
ROOT = next(p for p in Path(__file__).resolve().parents if (p / ".project-root").exists())
sys.path.insert(0, str(ROOT))
os.environ["PROJECT_ROOT"] = str(ROOT)

from src.utils import RankedLogger, instantiate_callbacks, instantiate_loggers, task_wrapper

log = RankedLogger(__name__, rank_zero_only=True)


@task_wrapper
def train(cfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    if cfg.get("seed"):
        L.seed_everything(cfg.seed, workers=True)

    log.info(f"Instantiating datamodule <{cfg.data._target_}>")
    datamodule: LightningDataModule = hydra.utils.instantiate(cfg.data)

    log.info(f"Instantiating model <{cfg.model._target_}>")
    model: LightningModule = hydra.utils.instantiate(cfg.model)

    log.info("Instantiating callbacks...")
    callbacks: list[Callback] = instantiate_callbacks(cfg.get("callbacks"))

    log.info("Instantiating loggers...")
    logger: list[Logger] = instantiate_loggers(cfg.get("logger"))

    log.info(f"Instantiating trainer <{cfg.trainer._target_}>")
    trainer: Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=logger)

    object_dict = {"cfg": cfg, "datamodule": datamodule, "model": model, "callbacks": callbacks,
                   "logger": logger, "trainer": trainer}  # fmt: skip

    if cfg.get("train"):
        log.info("Starting training!")
        trainer.fit(model=model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    train_metrics = trainer.callback_metrics

    if cfg.get("test"):
        log.info("Starting testing!")
        ckpt_path = trainer.checkpoint_callback.best_model_path
        if ckpt_path == "":
            log.warning("Best ckpt not found! Using current weights for testing...")
            ckpt_path = None
        trainer.test(model=model, datamodule=datamodule, ckpt_path=ckpt_path)
        log.info(f"Best ckpt path: {ckpt_path}")

    test_metrics = trainer.callback_metrics

    metric_dict = {**train_metrics, **test_metrics}
    return metric_dict, object_dict


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> float | None:
    metric_dict, _ = train(cfg)
    return metric_dict.get("val/loss")


if __name__ == "__main__":
    main()
