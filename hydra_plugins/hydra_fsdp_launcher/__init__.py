"""``hydra/launcher=hydra_fsdp``: every rank of every job a fresh process (docs/launcher.md). Hydra loads
launchers only from the ``hydra_plugins`` namespace, by the class's own module name: this stub is all that
lives here; the launcher is ``hydra_fsdp.HydraFSDPLauncher``. A vendored hydra_fsdp.py needs this folder
copied beside it (``hydra_plugins/hydra_fsdp_launcher/``, no ``hydra_plugins/__init__.py``)."""

from hydra.core.config_store import ConfigStore

import hydra_fsdp


class HydraFSDPLauncher(hydra_fsdp.HydraFSDPLauncher):
    pass


ConfigStore.instance().store(
    group="hydra/launcher", name="hydra_fsdp", node=hydra_fsdp.LauncherConf, provider="hydra_fsdp"
)
