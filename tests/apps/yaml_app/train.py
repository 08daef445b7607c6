"""A plain-YAML Hydra app in the lightning-hydra-template shape: config groups trainer, model, data.

The LightningModule lives under ``model`` and the datamodule under ``data``, so the strategy is
told where they are: ``strategy: {_target_: hydra_fsdp.lightning.HydraDDP, module_key: model,
datamodule_key: data}`` in configs/trainer/default.yaml.
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
