"""The sweep app (app.py beside this file), each child rank started by the very command that
``_rank_launch`` builds, ``python hydra_fsdp.py <launch file>``, in a new interpreter, as a person would
start one by hand: not forked by the fork server. Each child's pid is written to <job dir>/by_hand."""

import runpy
import subprocess
import sys
from pathlib import Path

import hydra_fsdp


class NewInterpreters:
    """In place of the sweep's fork server: run each child rank's command as a process of its own."""

    proc = None  # no server process to look after

    def start(self, command, env, log, timeout, on_failure):
        with open(log, "ab") as out:
            child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        with open(Path(log).parent / "by_hand", "a") as started:
            started.write(f"{child.pid} {' '.join(command)}\n")
        return child


hydra_fsdp._Sweep.started_fork_server = lambda sweep, lightning: NewInterpreters()
sys.argv[0] = "app.py"
runpy.run_path("app.py", run_name="__main__")
