"""What tests that share one sweep need: scenarios as Hydra configs, and the leak check.

A sweep's jobs are the product of its overrides; scenarios that differ in several keys at once
(stages, strategy, datamodule...) become one sweep as options of a config group ``case``, each a
``# @package _global_`` config that sets those keys as the command-line overrides would, found
through ``hydra.searchpath`` and swept as ``+case=a,b,...``. Each job runs in ``<sweep dir>/<case
name>``. One sweep then serves several tests: one rank 0 process and one fork server in all,
instead of one of each per test.

A fixture that runs a sweep for several tests checks, as each test is checked (conftest.py), that
no process outlives it: ``with nothing_outlives("..."):`` around what it starts.
"""

import contextlib
import os
import time
from pathlib import Path

from helpers import end_tree
from omegaconf import OmegaConf


def case_overrides(directory, cases):
    """Write ``cases`` ({name: {dotted key: value}}) as the config group ``case`` under
    ``directory``; return the overrides that sweep them, in that order, one job dir each."""
    group = Path(directory) / "case"
    group.mkdir(parents=True, exist_ok=True)
    for name, values in cases.items():
        config = OmegaConf.create()
        for key, value in values.items():
            OmegaConf.update(config, key, value, force_add=True)
        (group / f"{name}.yaml").write_text("# @package _global_\n" + OmegaConf.to_yaml(config))
    return (
        f"hydra.searchpath=[file://{Path(directory).resolve()}]",
        "hydra.sweep.subdir=${hydra:runtime.choices.case}",
        "+case=" + ",".join(cases),
    )


def children_of(pid):
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError):
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found[int(entry.name)] = (fields[0], cmdline.strip())
    return found


@contextlib.contextmanager
def nothing_outlives(what):
    """Fail if any process started inside (or an orphan of one) is still running after it."""
    before = set(children_of(os.getpid()))
    yield
    deadline = time.monotonic() + 10  # a child rank notices its parent's end within a second
    while True:
        left = {pid: info for pid, info in children_of(os.getpid()).items() if pid not in before}
        for pid, (state, _) in list(left.items()):
            if state == "Z":  # an orphan that exited: reap it
                os.waitpid(pid, os.WNOHANG)
                del left[pid]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        end_tree(pid)
        os.waitpid(pid, 0)
    assert not left, f"processes outlived {what} and were ended: " + "; ".join(
        f"pid {pid}: {cmdline[:300]}" for pid, (_, cmdline) in left.items()
    )
