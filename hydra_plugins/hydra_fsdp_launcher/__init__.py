"""``hydra/launcher=hydra_fsdp``: every rank of every job a fresh process (docs/launcher.md). Hydra loads
launchers only from the ``hydra_plugins`` namespace, by the class's own module name, and imports every
module there at the start of every Hydra app (``--help``, ``--cfg``, Tab completion): so this stub imports
nothing heavier than Hydra, and ``hydra_fsdp`` (torch, Lightning) only in ``setup``, when the launcher
runs. The launcher itself is ``hydra_fsdp.HydraFSDPLauncher``. A vendored hydra_fsdp.py needs this folder
copied beside it: copy ``hydra_fsdp.py`` and ``hydra_plugins/hydra_fsdp_launcher/`` (no
``hydra_plugins/__init__.py``)."""

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher


@dataclasses.dataclass
class LauncherConf:
    """``hydra/launcher=hydra_fsdp``'s settings (``hydra.launcher.*``, docs/launcher.md)."""

    _target_: str = "hydra_plugins.hydra_fsdp_launcher.HydraFSDPLauncher"
    # ranks per job, read per job (torchrun's name): by default the job's own trainer.devices
    nproc_per_node: Any = "${oc.select:trainer.devices,1}"
    # the job's accelerator, read per job: "cpu" claims cores, "gpu"/"cuda" GPUs, "auto" GPUs where there are
    accelerator: Any = "${oc.select:trainer.accelerator,auto}"
    n_jobs: int = 1  # jobs at once (joblib's name), each on devices of its own
    job_timeout: Any = None  # seconds a job may run: then its ranks' stacks go to their logs and they end
    rank_timeout: float = 600.0  # seconds for the fork server to start a rank
    # false: ranks 1..N-1 start once rank 0 has reached the process group (Lightning's order); true: at once
    start_ranks_together: bool = False
    shutdown_grace: float = 30.0  # seconds a rank has to exit after SIGINT/SIGTERM, then SIGKILL (torchrun's)


class HydraFSDPLauncher(Launcher):
    """What Hydra instantiates: it keeps the settings, and builds ``hydra_fsdp.HydraFSDPLauncher`` from them
    in ``setup``, the first time the launcher is used, and hands it every call."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        import hydra_fsdp  # torch and Lightning: only when the launcher runs

        self.engine = hydra_fsdp.HydraFSDPLauncher(**self.settings)
        self.engine.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
        return self.engine.launch(job_overrides, initial_job_idx)


ConfigStore.instance().store(
    group="hydra/launcher", name="hydra_fsdp", node=LauncherConf, provider="hydra_fsdp"
)
