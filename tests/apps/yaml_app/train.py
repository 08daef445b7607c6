"""A plain-YAML Hydra app: config groups trainer, model, data, and the strategy named in YAML.

``strategy: {_target_: hydra_fsdp.HydraDDP}`` in configs/trainer/default.yaml: the plain name,
whichever Lightning the program uses (``lightning.pytorch`` here, ``pytorch_lightning`` with
``trainer._target_=pytorch_lightning.Trainer`` and APP_LIGHTNING=pytorch_lightning).
"""

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    trainer = instantiate(cfg.trainer)
    trainer.fit(model=model, datamodule=datamodule)
    if cfg.test:
        trainer.test(model=model, datamodule=datamodule)


if __name__ == "__main__":
    main()
