"""Hydra's own launcher test suites (hydra.test_utils.launcher_common_tests), run on
``hydra/launcher=hydra_fsdp`` exactly as Hydra's joblib, submitit, ray and rq launchers run them in their
tests. LauncherTestSuite: sweeps in this process (Hydra's sweep runner, one sweep a test, many in one
process), of task functions the suite defines, locals among them, returning 100 (1.4 adds one that
raises, whose JobReturn must carry the exception with its traceback and cause). IntegrationTestSuite: an
app written to a file and run with -m in a process of its own. The launcher's settings are its defaults:
nproc_per_node follows trainer.devices, else 1, so every job is one rank, rank 0, as in a plain sweep.
The suites' tests are whatever the installed hydra-core has (1.3: 9 and 11; 1.4: 10 and 11); their
fixtures (hydra_sweep_runner, hydra_restore_singletons) are hydra-core's pytest plugin's."""

import pytest
from hydra.core.plugins import Plugins
from hydra.core.singleton import Singleton
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from hydra.version import VersionBase

from hydra_plugins.hydra_fsdp_launcher import HydraFSDPLauncher


@pytest.fixture(autouse=True)
def no_version_base_of_an_earlier_module():
    """As in a process of their own (Hydra's plugins run these suites alone): the suites expect Hydra's
    default version base (``hydra.job.chdir`` true on 1.3), and a module run before in this process (by
    pytest-xdist) may have left another in Hydra's VersionBase singleton, which Hydra's
    ``hydra_restore_singletons`` puts back as it found it."""
    Singleton._instances.pop(VersionBase, None)


def test_discovery():
    """Hydra finds the launcher among its plugins, as it does Hydra's own launchers."""
    assert HydraFSDPLauncher.__name__ in [x.__name__ for x in Plugins.instance().discover(Launcher)]


@pytest.mark.parametrize("launcher_name, overrides", [("hydra_fsdp", [])])
class TestHydraFSDPLauncher(LauncherTestSuite):
    """The launcher test suite on this launcher (hydra/launcher/hydra_fsdp: the plugin's ConfigStore)."""


@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [
        (
            {},
            [
                "-m",
                "hydra/job_logging=hydra_debug",
                "hydra/job_logging=disabled",
                "hydra/launcher=hydra_fsdp",
            ],
        )
    ],
)
class TestHydraFSDPLauncherIntegration(IntegrationTestSuite):
    """The integration test suite on this launcher: an app of its own, run with -m (these flags are the
    joblib launcher's, with its name changed)."""
