"""The helpers of lightning-hydra-template's src/utils that its train.py uses, cut down."""

import logging
from collections.abc import Callable
from typing import Any

import hydra
from lightning import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig


class RankedLogger(logging.LoggerAdapter):
    """A logger that logs on rank zero only (the template's src/utils/pylogger.py)."""

    def __init__(self, name: str = __name__, rank_zero_only: bool = False) -> None:
        super().__init__(logger=logging.getLogger(name), extra=None)
        self.rank_zero_only = rank_zero_only

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        if self.isEnabledFor(level):
            rank = getattr(rank_zero_only, "rank", None)
            msg = f"[rank: {rank}] {msg}"
            if not self.rank_zero_only or rank == 0:
                self.logger.log(level, msg, *args, **kwargs)


def task_wrapper(task_func: Callable) -> Callable:
    """The template's decorator: log, and re-raise, whatever the task raises."""

    def wrap(cfg: DictConfig):
        try:
            metric_dict, object_dict = task_func(cfg=cfg)
        except Exception:
            logging.getLogger(__name__).exception("")
            raise
        return metric_dict, object_dict

    return wrap


def instantiate_callbacks(callbacks_cfg: DictConfig | None) -> list[Callback]:
    callbacks: list[Callback] = []
    if not callbacks_cfg:
        return callbacks
    for cb_conf in callbacks_cfg.values():
        if isinstance(cb_conf, DictConfig) and "_target_" in cb_conf:
            callbacks.append(hydra.utils.instantiate(cb_conf))
    return callbacks


def instantiate_loggers(logger_cfg: DictConfig | None) -> list[Logger]:
    logger: list[Logger] = []
    if not logger_cfg:
        return logger
    for lg_conf in logger_cfg.values():
        if isinstance(lg_conf, DictConfig) and "_target_" in lg_conf:
            logger.append(hydra.utils.instantiate(lg_conf))
    return logger
