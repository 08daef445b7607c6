"""What ``hydra/launcher=hydra_fsdp`` costs the Hydra apps that do not use it. Hydra imports every module
under ``hydra_plugins`` at the start of every Hydra app of the environment (a plain run, ``--help``,
``--cfg``, Tab completion): the stub there must not import hydra_fsdp (torch, Lightning), only Hydra.

A plain Hydra app (no torch) runs in two environments that differ in one folder: this venv's
site-packages without hydra-fsdp (a folder of links to its entries, less hydra-fsdp's: its dist-info,
its editable .pth and finder, hydra_fsdp.py, hydra_plugins/hydra_fsdp_launcher), and the same with a
folder holding this repository's hydra_fsdp.py and hydra_plugins/hydra_fsdp_launcher/ (the vendored
layout) in front. Each runs ``python -S`` (no .pth file is read: the editable install's would put this
repository back on sys.path) with PYTHONPATH naming those folders."""

import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = 5  # of each, interleaved
APP = """\
import sys

import hydra


@hydra.main(version_base=None, config_path=None, config_name=None)
def main(cfg):  # after Hydra's plugin scan
    print("imported:", *(name for name in ("hydra_plugins.hydra_fsdp_launcher", "hydra_fsdp", "torch")
                         if name in sys.modules))


main()
"""


def _ours(name):
    """Whether a site-packages entry is hydra-fsdp's (hydra_fsdp.py, hydra_fsdp-0.2.0.dist-info,
    __editable__.hydra_fsdp-0.2.0.pth, its finder), or a .pth file."""
    ours = re.match(r"(__editable__[._])?hydra[-_.]fsdp([-_.]|$)", name.lower())
    return bool(ours) or name.endswith(".pth")


def _site_without_hydra_fsdp(farm):
    """``farm``: links to every entry of this venv's site-packages but hydra-fsdp's (and the .pth files,
    which ``python -S`` would not read anyway); its hydra_plugins a folder of links but to ours."""
    farm.mkdir()
    sites = dict.fromkeys(Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib"))
    for site in sites:
        for entry in site.iterdir():
            if _ours(entry.name) or (farm / entry.name).exists():
                continue
            if entry.name == "hydra_plugins":
                (farm / entry.name).mkdir()
                for plugin in entry.iterdir():
                    if plugin.name != "hydra_fsdp_launcher":
                        (farm / entry.name / plugin.name).symlink_to(plugin)
            else:
                (farm / entry.name).symlink_to(entry)
    return farm


def _vendored(folder):
    """``folder``: this repository's hydra_fsdp.py and hydra_plugins/hydra_fsdp_launcher/, as a user copies
    them (no hydra_plugins/__init__.py)."""
    folder.mkdir()
    shutil.copy(ROOT / "hydra_fsdp.py", folder)
    shutil.copytree(
        ROOT / "hydra_plugins" / "hydra_fsdp_launcher",
        folder / "hydra_plugins" / "hydra_fsdp_launcher",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return folder


def _run(tmp_path, pythonpath):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath)), "PYTHONNOUSERSITE": "1"}
    command = [sys.executable, "-S", str(tmp_path / "app.py"), f"hydra.run.dir={tmp_path / 'run'}"]
    start = time.perf_counter()
    done = subprocess.run(
        command, check=False, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stdout + done.stderr
    # no plugin failed to load (1.3: the namespace scan; 1.4: entry points too)
    failed = ("Error importing", "Error loading Hydra plugin")
    assert not any(error in done.stderr for error in failed), done.stderr
    (imported,) = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("imported:")]
    return seconds, imported


def test_the_stub_costs_apps_that_do_not_use_it_nothing(tmp_path):
    """After Hydra's plugin scan, the stub is imported, hydra_fsdp and torch are not; and a plain app starts
    at most 1.3 times as slowly with the stub as without it (medians of 5 runs each, interleaved)."""
    (tmp_path / "app.py").write_text(APP)
    without = [_site_without_hydra_fsdp(tmp_path / "site")]
    with_stub = [_vendored(tmp_path / "vendored"), *without]
    _, imported = _run(tmp_path, without)  # first runs, not timed: .pyc files written
    assert imported == [], "without: the app saw hydra_fsdp's plugin, or torch"
    _, imported = _run(tmp_path, with_stub)
    assert imported == ["hydra_plugins.hydra_fsdp_launcher"], "with: the stub imported more than Hydra"
    times = {"without": [], "with": []}
    for _ in range(RUNS):
        times["without"].append(_run(tmp_path, without)[0])
        times["with"].append(_run(tmp_path, with_stub)[0])
    medians = {case: statistics.median(seconds) for case, seconds in times.items()}
    print(
        f"plain Hydra app, medians of {RUNS}: with the stub {medians['with']:.3f} s,"
        f" without {medians['without']:.3f} s"
    )
    assert medians["with"] <= 1.3 * medians["without"], times
