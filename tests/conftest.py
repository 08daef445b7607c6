import ctypes
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import FSDP_ON_CPU, FSDP_ON_CPU_REASON, copy_app, end_tree

PR_SET_CHILD_SUBREAPER = 36


def pytest_configure(config):
    # Orphans of the processes a test started (a child rank whose parent died, a torchrun worker in a
    # session of its own) become children of pytest instead of init: the check below finds them.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # Sweeps start as from a terminal, SIGINT at its default, even where pytest was started with it
    # ignored (a background job of a shell without job control): a handler is reset by exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """Skip what runs HydraFSDP on the CPU where Lightning refuses it (tests/test_sweeps.py tests
    the refusal there): a test marked fsdp_cpu, or one parametrized with the FSDP strategy."""
    if FSDP_ON_CPU:
        return
    skip = pytest.mark.skip(reason=FSDP_ON_CPU_REASON)
    for item in items:
        params = getattr(item, "callspec", None)
        values = params.params.values() if params else ()
        if item.get_closest_marker("fsdp_cpu") or any(value in ("fsdp", "HydraFSDP") for value in values):
            item.add_marker(skip)


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


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Fail the test if any process it started (or an orphan of one) is still running after it."""
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
    assert not left, "processes outlived the test and were ended: " + "; ".join(
        f"pid {pid}: {cmdline[:300]}" for pid, (_, cmdline) in left.items()
    )


@pytest.fixture
def app(tmp_path):
    """A directory holding the sweep app (app.py) and a module next to it (shapes.py)."""
    return copy_app(tmp_path)
