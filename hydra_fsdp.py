# SPDX-License-Identifier: MIT
# hydra_fsdp -- one file, meant to be copied into a project: keep this header. The version below is
# that of the hydra_fsdp repository this copy was taken from (its README and tests live there).
"""Lightning's DDP, FSDP and FSDP2 strategies that work under Hydra, ``--multirun`` sweeps included.

``HydraDDP``, ``HydraFSDP`` and ``HydraModelParallel`` start every child rank of a Hydra job from that
job's own config, as rank 0's task function received it (pickled, so types survive), and run the job's
own task function on it. Lightning's own launcher re-runs ``sys.argv`` instead, which under
``--multirun`` is the whole sweep. Each job also runs on devices that no other running job holds (GPUs,
or on the CPU cores of its own), so that jobs run at once by Hydra's joblib and submitit_local launchers
never share one.

The sections follow one job, from rank 0's first look at it to a child rank's start:

1. *What rank 0 reads*: the running Hydra job (its task function and config) and the settings.
2. *What rank 0 gives a child: the launch file*: the task function and config pickled by reference,
   and ``_rank_launch``, which builds each child's command and environment.
3. *The fork server*: one process per sweep that imports torch and Lightning once and forks every
   child rank from it, with the child's side of a fork.
4. *The devices a job holds*: claims on GPUs and CPU cores that no other running job holds.
5. *Rank 0's sweep and job*: what lasts from job to job (``_Sweep``), a job's child ranks and their
   failures, the job itself (``_Job``); then a job's teardown (process groups), the memory freed
   between jobs, and the launcher that Lightning calls (``_HydraRankLauncher``).
6. *Every rank agrees*: the check, before each stage, that all ranks are about to run the same thing.
7. *The strategies*: the version checks, what every strategy adds, HydraFSDP's and
   HydraModelParallel's own parts, and the public classes of both Lightning namespaces.
8. *The launcher: every rank a fresh process* (``hydra/launcher=hydra_fsdp``): the sweep's process runs
   the sweeper and a job agent per job (a fork of it, which runs Hydra's ``run_job``); every rank of every
   job, rank 0 included, is a fork of the fork server with torchrun's environment, ranks 1..N-1 started
   once rank 0 reached the process group; the job's result is rank 0's.
9. *A child rank*: how a child rank runs the job, forked or started by hand (``python hydra_fsdp.py
   <launch file>``).

Private names of torch, Lightning and Hydra are used only where no public API does the job, and each is
guarded where it is used: a change upstream raises ``RankLaunchError`` naming it (``_upstream_changed``)
instead of hanging a job.

The processes, threads and locks, and who owns each (starts it, and ends or lets go of it):

==============================  =========================================================================
the sweep (a process)           Hydra's: the sweeper; on the strategies' route every job's rank 0 too (or a
                                joblib/submitit worker is rank 0). Owns the fork server, and under the
                                launcher the job agents. SIGINT/SIGTERM to it: see *stopping*, below.
a job agent (the launcher)      a fork of the sweep per running job, in a process group of its own: runs
                                Hydra's ``run_job``, starts, waits for and ends the job's ranks. Owned by
                                the sweep; it dies with the sweep (``_exit_with``).
the fork server                 one per sweep (one per job, a fork of its agent, for a task function no
                                child can import: ``_local_fork_server``):
                                forks every child rank, ignores SIGINT. Owned by the connection that
                                started it; it ends as that one closes, its children with it.
a child rank                    a fork of the fork server, in a process group of its own (a terminal's
                                Ctrl-C reaches rank 0, or the sweep, alone), dying with the server
                                (``PR_SET_PDEATHSIG``). Owned by its job: ``_ChildRanks``.
the fork server's reader        (thread "hydra-fsdp-fork-server") of each process holding a connection
                                (rank 0, an agent): reads its replies, notifies ``said``, starts a failed
                                child's ``on_failure`` (the stage's abort) on a thread of its own.
the signal watch                (thread "hydra-fsdp-signals") of rank 0's job, from its start to its end
                                (``_SignalWatch``): passes SIGINT/SIGTERM on to the children once.
the grace                       (thread "hydra-fsdp-grace") of a stopped job (``_ChildRanks.stop``): ends
                                the children still running when the grace ends.
``_ChildRanks.lock``            a job's: held while signals are written to the fork server (``stop``,
                                ``add``), from the watch thread, a signal handler or the main thread.
``_StageAbort.lock``            a job's: held by the abort of its stage under way (a thread of its own);
                                the stage's end waits for it ``_KILL_WAIT`` s at most.
claim flocks                    one file per device (and a queue's, held while a job claims, polling
                                for busy devices) in the claims folder, locked by the process that claims
                                the job's devices (rank 0, or the job's agent) for the job's life; the
                                kernel lets go of them when that process ends.
==============================  =========================================================================

*Stopping*: on SIGINT (Ctrl-C) or SIGTERM, on both routes, every running rank gets that signal once, then
a grace to exit (its graceful shutdown: Lightning's ``on_exception`` hooks, its loggers' finalize; 30 s by
default, ``shutdown_grace``: the strategies' argument or ``MUSHIN_DDP_SHUTDOWN_GRACE``, and
``hydra.launcher.shutdown_grace``), then SIGKILL (``_ChildRanks.close``, in the shape of torch elastic's
``PContext.close``). The job is reported as interrupted, no next job starts, and the sweep exits 130 (or by
SIGINT) or 143. A second Ctrl-C kills every rank at once.
"""

__version__ = "0.2.0"

import atexit
import contextlib
import copy
import ctypes
import dataclasses
import faulthandler
import fcntl
import functools
import gc
import hashlib
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import logging
import math
import operator
import os
import pickle
import random
import re
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from hydra.experimental.callback import Callback
from hydra.plugins.launcher import Launcher
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

__all__ = ["ChildRankError", "HydraDDP", "HydraFSDP", "HydraModelParallel", "RankLaunchError"]

log = logging.getLogger(__name__)

# The Lightning namespaces, by the name a user reaches them under (``hydra_fsdp.lightning.HydraDDP``).
_NAMESPACES = {"pytorch_lightning": "pytorch_lightning", "lightning": "lightning.pytorch"}
# Lightning Fabric's, by the package that holds it: ``hydra_fsdp.fabric.HydraDDP`` is on the one imported.
_FABRIC_NAMESPACES = {"lightning_fabric": "lightning_fabric", "lightning": "lightning.fabric"}

LAUNCH_DELAY_ENV = "MUSHIN_DDP_LAUNCH_DELAY"
DEFAULT_LAUNCH_DELAY = 1.0
# On SIGINT or SIGTERM, how long the job's child ranks have to exit before SIGKILL (torchrun's 30 s); the
# strategies' shutdown_grace argument wins over it.
SHUTDOWN_GRACE_ENV = "MUSHIN_DDP_SHUTDOWN_GRACE"
DEFAULT_SHUTDOWN_GRACE = 30.0
DEFAULT_RANK_TIMEOUT = 600.0
_LAUNCH_FILE = "rank_config.pickle"  # in the job's dir while it runs: its config, and all a child needs
_CHILD_ENV = "HYDRA_FSDP_CONFIG"  # set for the child ranks hydra_fsdp starts: the config they run
_SERVER_ENV = "HYDRA_FSDP_FORK_SERVER"  # set for the fork server: what it imports (see _ForkServer)
# Devices a running job holds that no other running job holds (see "the devices a job holds").
_CLAIMS_ENV = "HYDRA_FSDP_CLAIMS"  # the folder of this user's claims on this node, or "off": claim nothing
_GPUS_ENV = "HYDRA_FSDP_GPUS"  # the GPUs (as torch numbers them, "0,1,2,3") a sweep's jobs may claim
_JOB_GPUS_ENV = "HYDRA_FSDP_JOB_GPUS"  # set for the child ranks: the GPUs their job holds
_RANK_CORES_ENV = "HYDRA_FSDP_RANK_CORES"  # set for each child rank: the CPU cores it runs on
_CHECK_IN_KEY = "hydra_fsdp/ready/{}"
_GO_KEY = "hydra_fsdp/go"  # rank 0 runs this job with these children: they may run the task function
_STAGE_KEY = "hydra_fsdp/stage/{}"  # the fallback: the stages rank 0 runs, in order
# What a job may change in rank 0's environment (Lightning sets MASTER_*, deletes WORLD_SIZE): put back.
_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
# Rank 0 is the sweep: on a dead peer its NCCL groups abort and keep the process. 2 is torch's CleanUpOnly,
# "just clean up collectives and abort communicators without tearing down process" (ProcessGroupNCCL.hpp);
# not its default, 3, which tears it down, nor 0, which aborts nothing (a timed-out collective would be left
# running on rank 0's GPU). For its jobs only; a user's value stands.
_NCCL_KEEPS_THE_PROCESS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
# All that a job may change in rank 0's environment (the threads: _placement), put back at the job's end.
_JOB_ENV = (*_RENDEZVOUS_ENV, *_NCCL_KEEPS_THE_PROCESS, "OMP_NUM_THREADS")
# How often a wait looks again at what only polling shows (a check-in): on the path of every job.
_POLL_INTERVAL = 0.01
_CLAIM_POLL = 0.1  # how often a job that waits for devices looks again
_LOG_TAIL_LINES = 20  # of a failed child's log, shown in its job's error
_LOG_TAIL_BYTES = 1 << 16  # read from the end of that log to find them
_DIFFERENCES_SHOWN = 5
_PEER_EXIT_GRACE = 2.0  # after a collective failed on rank 0: how long a child that caused it may take
_STACK_DUMP_SIGNAL = signal.SIGUSR1  # a child dumps its stack to its log on it (faulthandler)
_STACK_DUMP_WAIT = 0.5
_PR_SET_PDEATHSIG = 1  # prctl(2): a signal for this process when its parent ends
_KILL_WAIT = 5.0  # for a child to be reaped after SIGKILL: one the kernel holds is left behind
# A child waits on rank 0's store without a deadline of its own: rank 0 ends its children itself.
_CHILD_STORE_TIMEOUT = timedelta(days=1)
_WHERE_CLASSES_GO = (
    "Define the config's dataclasses and Enums at the top level of a module, or of the launching script"
    ' outside its `if __name__ == "__main__":` block, which a child rank imports without running it.'
)
# In a child rank hydra_fsdp started, the job it runs: its task function and config (see _hydra_job).
_child_job: dict | None = None
# The releases CI ran.
_KNOWN_TO_WORK = "torch 2.3 to 2.15, Lightning 2.2 to 2.6, hydra-core 1.3.0 to 1.3.8 and 1.4.0rc3"


class RankLaunchError(RuntimeError):
    """The job's ranks cannot all run the same job: raised before they diverge, nothing left running."""


class ChildRankError(RuntimeError):
    """A child rank failed, hung or was ended; its job fails, the sweep goes on."""


def _upstream_changed(name: str, why: str) -> RankLaunchError:
    """The error for a private name of torch, Lightning or Hydra that is not what it was."""
    return RankLaunchError(f"hydra_fsdp relies on {name}, private to its package, to {why}; this release"
                           f" differs. Known to work: {_KNOWN_TO_WORK}. Install one, or adapt hydra_fsdp.py"
                           " where it calls _upstream_changed for it.")  # fmt: skip


# -------------------- what rank 0 reads


def _launch_delay(name: str = LAUNCH_DELAY_ENV, default: float = DEFAULT_LAUNCH_DELAY) -> float:
    """The seconds an environment variable (``name``) sets: by default the stagger between two child
    starts; also the shutdown grace (``SHUTDOWN_GRACE_ENV``)."""
    raw = os.environ.get(name, str(default))
    with contextlib.suppress(ValueError):  # not a number: the same error as a number out of range
        if 0 <= float(raw) < math.inf:
            return float(raw)
    raise RankLaunchError(f"{name}={raw!r} is not a number of seconds: expected finite, >= 0 (0: none).")


def _hydra_job() -> dict | None:
    """The running Hydra job, or None outside one. In a child rank hydra_fsdp started, the job that
    ``_run_child_rank`` runs (``_child_job``). Elsewhere (rank 0, and every rank under torchrun or SLURM,
    where Hydra runs the task function itself) the local variables of Hydra's ``run_job``, found on the
    stack: Hydra has no public way to name the running task function and its config. hydra-core 1.4 moved
    ``run_job``'s body into ``_run_job``, which ``run_job`` calls under the job's execution whitelist."""
    if _child_job is not None:
        return _child_job
    from hydra.core import utils

    body = "_run_job" if hasattr(utils, "_run_job") else "run_job"
    frame = inspect.currentframe()
    while frame is not None and frame.f_code is not getattr(utils, body).__code__:
        frame = frame.f_back
    if frame is None:
        return None
    needed = {"task_function", "task_cfg", "config", "hydra_context", "ret"}
    if not needed <= set(frame.f_locals):  # Python 3.13: a proxy, whose keys() is a list
        locals_of = f"the local variables of hydra.core.utils.{body} {sorted(needed)}"
        raise _upstream_changed(locals_of, "find the running job")
    return frame.f_locals


def _job_config(hydra_job: dict) -> DictConfig:
    """The config Hydra gave the task function, copied as ``run_job`` copied it (the task may have changed
    its own since), with the values rank 0 cached since (``${now:}``)."""
    task_cfg = copy.deepcopy(hydra_job["config"])
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    OmegaConf.set_cache(task_cfg, OmegaConf.get_cache(hydra_job["task_cfg"]))
    return task_cfg


def _resolved_where_possible(config: Any) -> Any:
    """Every value of ``config`` resolved, for a child to read back literally; a value that cannot be
    resolved (``???``, an interpolation of a missing key) is kept as written. Resolving also caches each
    ``${now:...}`` in the config's root, so that rank 0 reads the same time whenever it looks again."""
    if OmegaConf.is_config(config):
        values = _each_value(config, _resolved_where_possible)
        return values if isinstance(config, DictConfig) else list(values.values())
    value = config.name if isinstance(config, Enum) else config
    if isinstance(value, str):  # escaped, for OmegaConf to read it back literally
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    return value


def _types_of(config: Any) -> Any:
    """The type of every value of ``config`` by name, and of every node under the key ``""``: the ranks
    compare them, since configs of equal values can differ in type (an Enum against its name)."""
    if not OmegaConf.is_config(config):
        return type(config).__qualname__
    return {"": getattr(OmegaConf.get_type(config), "__qualname__", None), **_each_value(config, _types_of)}


def _each_value(config: Any, value_of: Callable) -> dict:
    """``value_of`` each value of a DictConfig or ListConfig, by key or index; where a value cannot be
    read, the value as written."""
    values, as_written = {}, None  # as_written: the whole config as written, made at the first such value
    for key in config.keys() if isinstance(config, DictConfig) else range(len(config)):
        try:
            values[key] = value_of(config[key])
        except OmegaConfBaseException:
            as_written = as_written or OmegaConf.to_container(config, resolve=False)
            values[key] = as_written[key]
    return values


def _launching_script() -> dict:
    """How a child finds rank 0's ``__main__``: its task function, ``_target_: __main__.X``."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and not spec.name.endswith("__main__"):
        return {"module": spec.name}
    if spec is None and (path := _main_file()) is not None:
        return {"path": path}
    return {}  # an interactive session or a package's __main__: nothing safe to re-import


# -------------------- what rank 0 gives a child: the launch file


class _ByReference(pickle.Pickler):
    """Pickle a task function and a config's classes by reference (module and name), as multiprocessing's
    spawn does, with three exceptions a child could not import otherwise:

    - a function under decorators (``@hydra.main`` wraps the user's ``main``) is pickled as "the function
      n ``__wrapped__`` levels under the module's ``main``", since only the outermost has the name;
    - a copy of a function or class of the launching script, which a worker of joblib or submitit received
      by value (its ``__main__`` is the launcher's), is pickled as "the one at this line of that script";
    - a dataclass made at run time (hydra-zen's ``builds``, whose module is ``types``) as its fields.

    ``main_names`` records, by module, one name pickled from it, so that a ``__main__`` one can be named in
    the error when there is no script for a child to import.
    """

    def __init__(self, file: io.BytesIO, script: str | None = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.main_names: dict = {}
        self.script = script  # the launching script, where this process's __main__ is not it (a worker)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":  # rank 0's result (_hand_back)
            return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        if not isinstance(obj, (types.FunctionType, type)):
            return NotImplemented
        self.main_names.setdefault(obj.__module__, obj.__qualname__)
        found, wrappers = _attribute(obj.__module__, obj.__qualname__), 0
        while found is not None and found is not obj:
            found, wrappers = getattr(found, "__wrapped__", None), wrappers + 1
        if found is obj and wrappers:
            under = operator.attrgetter(".".join(["__wrapped__"] * wrappers))  # picklable, as its path
            return under, (_attribute(obj.__module__, obj.__qualname__),)
        if found is None and obj.__module__ == "__main__" and "<" not in obj.__qualname__:
            # A copy of something the launching script defines, pickled by value (cloudpickle) into a worker
            # (joblib's, submitit's) whose __main__ is the launcher's: a child finds it in the script itself.
            # cloudpickle keeps a function's line and its module's __file__, not its code's file name.
            path = getattr(obj, "__globals__", {}).get("__file__")
            if path is not None and os.path.isfile(path) and os.path.abspath(path) != _main_file():
                self.script = os.path.abspath(path)
            if self.script is not None:
                line = obj.__code__.co_firstlineno if isinstance(obj, types.FunctionType) else None
                return _in_script, (self.script, obj.__qualname__, line)
        if found is None and obj.__module__ == "types" and dataclasses.is_dataclass(obj):
            fields = [
                (f.name, f.type) + (() if f.default is dataclasses.MISSING else (f.default,))
                for f in dataclasses.fields(obj)
            ]
            return _made_again, (obj.__qualname__, fields)
        return NotImplemented


def _attribute(module: str, qualname: str) -> Any:
    try:
        return functools.reduce(getattr, qualname.split("."), sys.modules[module])
    except (KeyError, AttributeError):
        return None


def _main_file() -> str | None:
    path = getattr(sys.modules["__main__"], "__file__", None)
    return None if path is None else os.path.abspath(path)


def _in_script(script: str, qualname: str, line: int | None) -> Any:
    """In a child, which imported ``script`` as ``__main__``: its ``qualname``, or for a function the one
    under its decorators (``__wrapped__``) whose code starts at ``line`` of the script."""
    found = _attribute("__main__", qualname)
    while line is not None and found is not None:
        code = getattr(found, "__code__", None)
        if code is not None and (code.co_filename, code.co_firstlineno) == (script, line):
            break
        found = getattr(found, "__wrapped__", None)
    if found is None:
        raise RankLaunchError(f"A child rank cannot find {qualname} (line {line}) in {script}, where rank 0's"
                              " was defined: the script changed while the sweep ran, or defines it only as"
                              f" __main__. {_WHERE_CLASSES_GO}")  # fmt: skip
    return found


def _made_again(qualname: str, fields: list) -> type:
    """A dataclass made at run time, made again in a child: its name, fields, types and defaults."""
    made = dataclasses.make_dataclass(qualname.rpartition(".")[2], fields, kw_only=True)
    made.__module__, made.__qualname__ = "types", qualname
    return made


def _pickled(value: Any, what: str, script: str | None = None) -> tuple:
    """``value`` pickled by reference for a child, or None if it cannot be; why not (else ""); and the
    launching script it found the value's ``__main__`` parts in, where this process's ``__main__`` is not
    it (else None)."""
    buffer = io.BytesIO()
    pickler = _ByReference(buffer, script)
    try:
        pickler.dump(value)
    except Exception as error:  # noqa: BLE001 - PicklingError, or what an object's own __reduce__ raises
        return None, f"{what} cannot be pickled by reference: {error}", None
    if "__main__" in pickler.main_names and not (pickler.script or _launching_script()):
        main = f"__main__.{pickler.main_names['__main__']}"
        return None, f"{what} needs {main}, of an interactive session, which a child rank cannot import", None
    return buffer.getvalue(), "", pickler.script


def _write_launch(path: Path, hydra_job: dict, spec: "_LaunchSpec") -> bool:
    """Save at ``path`` what a child needs to run the job as rank 0 runs it; return whether the children
    run the task function (else the fallback: the config contract)."""
    _resolved_where_possible(hydra_job["task_cfg"])  # caches every ${now:...} rank 0 will read
    task_cfg = _job_config(hydra_job)
    # The task function first: where it is a worker's copy of the script's, it names the script.
    task, why_not, script = _pickled(hydra_job["task_function"], "the task function")
    config, why_not_config, script = _pickled(task_cfg, "the job's config", script)
    if config is None:
        raise RankLaunchError(f"Child ranks cannot have the config: {why_not_config}. {_WHERE_CLASSES_GO}")
    if task is None and (spec.lightning.endswith("fabric") or spec.module_key is None):  # no fallback
        raise RankLaunchError(f"{why_not}. Child ranks need it defined at an importable file's top level.")
    if task is None:
        missing = [key for key in ("trainer", spec.module_key) if key not in task_cfg]
        if missing:
            raise RankLaunchError(f"Child ranks cannot run this job: {why_not}, and the job's config has no"
                                  f" {', '.join(repr(k) for k in missing)} key (it has:"
                                  f" {', '.join(map(str, task_cfg)) or 'nothing'}) for the trainer and"
                                  " module. Define the task function at an importable file's top level, or"
                                  " add them (module_key='model' names its key).")  # fmt: skip
        log.warning(f"hydra_fsdp: child ranks build the config's trainer and module, because {why_not}.")
    # cwd: Hydra's working_dir, under hydra.job.chdir, is the job's dir as given: relative. whitelist: the
    # execution whitelist of hydra-core >= 1.4.
    launch = {"module": __name__, "sys_path": list(sys.path), "sys_argv": list(sys.argv), "cwd": os.getcwd(),
              "main": {"path": script} if script else _launching_script(),
              "hydra": _resolved_where_possible(HydraConfig.get()), "config": config, "task": task,
              "resolved": _resolved_where_possible(task_cfg),
              "contract": {"module_key": spec.module_key, "datamodule_key": spec.datamodule_key},
              "whitelist": getattr(hydra_job["hydra_context"], "execution_whitelist", None)}  # fmt: skip
    _write_private(path, pickle.dumps(launch))
    return task is not None


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` at ``path`` (a pickle a rank loads), readable and writable by its owner only from its
    creation: into a new file of its own (O_EXCL, mode 0o600), renamed over ``path`` once whole."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _rank_launch(job: "_Job", hydra_job: dict) -> bool:
    """Start child ranks 1..N-1 of the running Hydra job into ``job.children``, each as::

        LOCAL_RANK=<r> NODE_RANK=0 WORLD_SIZE=<N> MASTER_ADDR=<address> MASTER_PORT=<port> \\
        HYDRA_FSDP_CONFIG=<launch file> PYTHONUNBUFFERED=1 \\
            python /path/to/hydra_fsdp.py <launch file>  < /dev/null  >> <job dir>/rank_<r>.log 2>&1

    where ``<launch file>`` is ``<job dir>/rank_config.pickle`` (``_write_launch``); and, where the job
    claimed them (``_placement``), ``HYDRA_FSDP_RANK_CORES=<the rank's cores>`` and ``OMP_NUM_THREADS=<its
    threads>`` on the CPU, ``HYDRA_FSDP_JOB_GPUS=<the job's GPUs>`` on CUDA; with the rest of rank 0's
    environment, in its working directory, ``MUSHIN_DDP_LAUNCH_DELAY`` seconds apart. Return whether the
    children run the task function (else the fallback: the config contract).

    That command is a real one: run by hand, with that environment, while rank 0 waits for its children,
    it joins the job as a forked child would (``__main__`` at the end of this file). The sweep's fork server
    runs the same thing in a fork of itself instead, which is up in milliseconds where a new interpreter
    takes seconds to import torch and Lightning.
    """
    spec, config_path, delay = job.spec, job.children.job_dir / _LAUNCH_FILE, _launch_delay()
    runs_task = _write_launch(config_path, hydra_job, spec)
    command = [sys.executable, os.path.abspath(__file__), str(config_path)]
    env = {**os.environ, "MASTER_ADDR": spec.address, "MASTER_PORT": str(job.store.port), "NODE_RANK": "0"}
    # PYTHONUNBUFFERED: a killed child's last words are in its log
    env.update({_CHILD_ENV: str(config_path)}, WORLD_SIZE=str(spec.world_size), PYTHONUNBUFFERED="1")
    if job.placement.gpus is not None:
        env[_JOB_GPUS_ENV] = ",".join(map(str, job.placement.gpus))
    for rank in range(1, spec.world_size):
        if rank > 1 and delay:
            time.sleep(delay)
        env = dict(env, LOCAL_RANK=str(rank))
        if job.placement.cores[rank] is not None:
            env[_RANK_CORES_ENV] = ",".join(map(str, job.placement.cores[rank]))
        server = job.sweep.started_fork_server(spec.lightning)
        proc = server.start(command, env, job.children.log(rank), timeout=spec.rank_timeout,
                            on_failure=functools.partial(job.abort.abort, rank))  # fmt: skip
        job.children.add(rank, proc)
    return runs_task


# -------------------- the fork server


def _wait_until(said: threading.Condition, done: Callable[[], Any], timeout: float | None) -> bool:
    """Whether ``done()`` holds within ``timeout`` s: asked again whenever ``said`` is notified (a fork
    server said something), and every ``_POLL_INTERVAL`` for what only polling shows (a check-in)."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    with said:
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            said.wait(min(left, _POLL_INTERVAL))
    return True


class _ForkServer:
    """A process that imports torch, Lightning and Hydra once and forks every child rank of a sweep.

    A fork of it is up in milliseconds, not seconds, and still a fresh process (rank 0's script imported
    anew, the job's environment): the server imports nothing more, starts no thread, never touches CUDA.
    Run as ``python /path/to/hydra_fsdp.py``, it serves connections (Unix sockets of datagrams, each message
    whole): on each, a request to fork a child or to signal one of that connection's children; it answers
    the child's pid and later its exit code on the same connection (read by ``listen``'s thread, which
    notifies ``said`` and starts a failed child's ``on_failure`` on a thread of its own). The first
    connection, the owner's, also hands the server new ones (``connect``: a job agent's, which it ends
    with). A connection's children end as it closes, and all of them as the server's owner ends.
    """

    def __init__(self, lightning: str, env_set: Any) -> None:
        # env_set: the job's environment, the children's, not the server's
        env = {key: value for key, value in os.environ.items() if key not in env_set}
        self.imports = [name for name in (lightning, "hydra_zen") if sys.modules.get(name)]  # the sweep's
        self.conn, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server = {"sys_path": sys.path, "module": __name__, "imports": self.imports, "fd": theirs.fileno()}
        env.update({_SERVER_ENV: json.dumps(server)}, PYTHONUNBUFFERED="1", PYTORCH_NVML_BASED_CUDA_CHECK="1")
        command = [sys.executable, os.path.abspath(__file__)]
        # Its stdout, which its imports may print to, is stderr: only the connections carry replies.
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=2,
                                     pass_fds=[theirs.fileno()])  # fmt: skip
        theirs.close()

    def listen(self, said: threading.Condition) -> "_ForkServer":
        """Read this connection's replies on a thread of this process (a job agent's after its fork)."""
        self.said, self.started = said, []  # started: the pids the server forked, not yet taken
        self.exit_codes: dict[int, int] = {}
        self.on_failure: dict[int, Callable[[], None]] = {}  # by pid, of each child still running
        self.lost = False  # the server died, or this connection did, and its children with it
        threading.Thread(target=self._read_replies, name="hydra-fsdp-fork-server", daemon=True).start()
        return self

    def connect(self) -> "_ForkServer":
        """A new connection to the server, for a job agent to fork: its ``listen`` starts its reader. The
        owner closes its own copy (``conn.close()``) once the agent has it."""
        other = copy.copy(self)
        other.conn, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        socket.send_fds(self.conn, [b"{}"], [theirs.fileno()])
        theirs.close()
        return other

    def _read_replies(self) -> None:
        try:
            for reply in map(json.loads, iter(functools.partial(self.conn.recv, 1 << 16), b"")):
                with self.said:
                    if "started" in reply:
                        self.started.append(reply["started"])
                    else:
                        self.exit_codes[reply["exited"]] = reply["code"]
                    on_failure = self.on_failure.pop(reply.get("exited"), None)
                    self.said.notify_all()
                if reply.get("code") and on_failure is not None:  # one that blocks holds up no reply
                    abort = functools.partial(_logged_if_it_fails, on_failure)
                    threading.Thread(target=abort, name="hydra-fsdp-abort", daemon=True).start()
        except OSError:  # the connection was closed here, or reset
            pass
        finally:  # the server ended, or its replies did: no wait may outlast it
            with self.said:
                self.lost = True
                self.said.notify_all()

    def start(self, command: list, env: dict, log: Path, timeout: float,
              on_failure: Callable[[], None]) -> "_ForkedChild":  # fmt: skip
        """Have the server fork a child running ``command`` with ``env`` into ``log`` within ``timeout``
        s; ``on_failure`` is called, on a thread of its own, if it exits with an error."""
        request = {"command": command, "env": env, "cwd": os.getcwd(), "log": str(log)}
        with contextlib.suppress(OSError):  # a server that died says so by its end
            self.conn.sendall(json.dumps(request).encode())
        if not _wait_until(self.said, lambda: self.started or self.lost, timeout) or not self.started:
            how = "and ended (its error is above)" if self.lost else f"within {timeout:g} s and was ended"
            self.end()
            raise ChildRankError(f"hydra_fsdp's fork server (pid {self.proc.pid}), importing"
                                 f" {', '.join(self.imports)} for the sweep's ranks, started none {how}."
                                 " Raise rank_timeout if imports are this slow here.")  # fmt: skip
        with self.said:
            pid = self.started.pop(0)
            if pid not in self.exit_codes:
                self.on_failure[pid] = on_failure
        return _ForkedChild(self, pid)

    def close(self) -> None:
        """Close the owner's connection: the server ends, and with it any child still running. The server
        reaps each child it kills, and a child the kernel holds (uninterruptible sleep) would keep it, and so
        the sweep's end, waiting: after ``_KILL_WAIT`` s the server is killed, the child left behind. Shut
        first: a close alone, while the reader thread waits in recv on it, tells the server nothing."""
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        try:
            self.proc.wait(_KILL_WAIT)
        except subprocess.TimeoutExpired:
            log.warning(f"hydra_fsdp: the fork server (pid {self.proc.pid}) did not end {_KILL_WAIT:g} s"
                        " after the sweep's end (a child stuck in the kernel?): it was killed.")  # fmt: skip
            self.end()

    def send_signal(self, pid: int, signum: int) -> None:
        """Have the server send ``signum`` to this connection's child ``pid``, from any thread (each message
        is sent whole). Only the server, which reaps its children, knows that ``pid`` is still its child's:
        rank 0 hears of a child's exit only after it was reaped, when its pid may be another process's."""
        with contextlib.suppress(OSError):  # a server that died took its children with it
            self.conn.sendall(json.dumps({"signal": [pid, signum]}).encode())

    def end(self) -> None:
        """Kill the server, and its children with it; reaped within ``_KILL_WAIT`` s where this process
        started it (else not its to reap), or left to the kernel."""
        self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(_KILL_WAIT)


def _logged_if_it_fails(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception:  # a failed child's abort: the job fails with the child's error all the same
        log.exception("hydra_fsdp: aborting the stage of a failed child rank failed")


class _ForkedChild(NamedTuple):
    """A child rank the fork server started: the part of ``Popen`` rank 0 uses."""

    server: _ForkServer
    pid: int

    def poll(self) -> int | None:
        return self.server.exit_codes.get(self.pid, -signal.SIGKILL if self.server.lost else None)

    def wait(self, timeout: float | None = None) -> int:
        if not _wait_until(self.server.said, lambda: self.poll() is not None, timeout):
            raise subprocess.TimeoutExpired(f"child rank pid {self.pid}", timeout)
        return self.poll()

    def send_signal(self, signum: int) -> None:
        self.server.send_signal(self.pid, signum)  # which it sends only to a child it has not reaped

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _serve_forks(imports: list, owner: int) -> None:
    """The fork server's loop: serve each connection's requests, report each child's exit to its own."""
    gc.disable()  # collecting a growing heap would take a fifth of the imports' time
    for name in imports:  # what every child needs, imported once for all of them
        importlib.import_module(name)
    # The children's collections skip what the server holds (0.2 s, and a copy of every page).
    gc.freeze()
    gc.enable()
    # A child has its SIGINT handler back, in a process group of its own: its parent passes a signal on.
    sigint, parent = signal.signal(signal.SIGINT, signal.SIG_IGN), os.getppid()
    conns, children = {owner: socket.socket(fileno=owner)}, {}  # by fd; pid: its connection's fd, or None
    while os.getppid() == parent and owner in conns:
        for fd in select.select(list(conns), [], [], _POLL_INTERVAL)[0]:
            message, fds = b"", []
            with contextlib.suppress(OSError):  # reset: as closed
                message, fds, *_ = socket.recv_fds(conns[fd], 1 << 20, 1)
            if not message or fds:
                conns.update({new: socket.socket(fileno=new) for new in fds})
                if not message:  # its children end with it (reaped below)
                    conns.pop(fd).close()
                    for pid in [pid for pid, to in children.items() if to == fd]:
                        os.kill(pid, signal.SIGKILL)
                        children[pid] = None
                continue
            request = json.loads(message)
            if "signal" in request:  # only to a child of its own not reaped, whose pid is still its own
                pid, signum = request["signal"]
                if children.get(pid) == fd:
                    os.kill(pid, signum)
                continue
            pid = os.fork()
            if pid == 0:
                _run_forked(request, list(conns), sigint)
            children[pid] = fd
            _reply(conns[fd], started=pid)
        for pid in list(children):
            exited, status = os.waitpid(pid, os.WNOHANG)
            if exited:
                to = children.pop(pid)
                if to in conns:
                    _reply(conns[to], exited=pid, code=os.waitstatus_to_exitcode(status))
    for pid in children:  # the owner is gone, and with it every job
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)  # SIGKILLed: bounded, but for a child the kernel holds; nothing waits on this
    os._exit(0)  # nothing to clean up: finalizing torch would cost rank 0 most of a second


def _reply(conn: socket.socket, **reply: Any) -> None:
    with contextlib.suppress(OSError):  # a connection whose reader is gone
        conn.send(json.dumps(reply).encode())


def _set_rank_zero_only(lightning: str, rank: int) -> None:
    """Tell Lightning's ``rank_zero_only`` the rank it read at import, in the server."""
    rank_zero_only = importlib.import_module(f"{lightning}.utilities.rank_zero").rank_zero_only
    if not hasattr(rank_zero_only, "rank"):
        raise _upstream_changed(f"{lightning}.utilities.rank_zero_only.rank", "tell a child its rank")
    rank_zero_only.rank = rank


def _run_forked(request: dict, server_fds: list, sigint: Any) -> None:
    """In a fresh fork of the server: become the child rank ``request`` starts, in a process group of its
    own (a terminal's Ctrl-C reaches the process that forwards it to the ranks, once), ending with the
    server."""
    try:
        _exit_with(os.getppid())
        os.setpgid(0, 0)
        for fd in server_fds:
            os.close(fd)
        signal.signal(signal.SIGINT, sigint)
        with open(os.devnull, "rb") as stdin, open(request["log"], "ab") as log_file:
            for opened, fd in ((stdin, 0), (log_file, 1), (log_file, 2)):
                os.dup2(opened.fileno(), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        # What a new process reads at its start, read again in the job's environment: Lightning's rank
        # and the threads. And the random seeds: numpy and torch seed once per process, so that every fork
        # would draw the server's numbers (Python's random reseeds itself in a fork).
        for lightning in [name for name in _NAMESPACES.values() if sys.modules.get(name)]:  # None: blocked
            _set_rank_zero_only(lightning, int(os.environ["LOCAL_RANK"]))
        if "OMP_NUM_THREADS" in os.environ:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        torch.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        _run_child_rank(request["command"][-1])  # what the command runs, without a new interpreter
    except BaseException:  # noqa: BLE001 - whatever it is, its traceback goes to the child's log
        traceback.print_exc()
    os._exit(1)


def _exit_with(parent: int) -> None:
    """End this child the moment ``parent``, which started it, ends (SIGKILL, a crash): never an orphan,
    never a rank that runs on unseen while a poll notices."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before that
        os._exit(1)


# -------------------- the devices a job holds


def _claims_folder() -> Path | None:
    """Where this user's running jobs claim devices on this node (a folder only they can write to), or
    None where claiming is off."""
    setting = os.environ.get(_CLAIMS_ENV, "")
    if setting == "off":
        return None
    folder = Path(setting or f"/tmp/hydra_fsdp-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700, parents=True)
    found = os.lstat(folder)  # the folder itself, never followed: another user may make a symlink in /tmp
    what = f"owner uid {found.st_uid}, mode {found.st_mode & 0o777:o}"
    what = f"a symlink to {os.readlink(folder)}" if folder.is_symlink() else what
    if folder.is_symlink() or not folder.is_dir() or found.st_uid != os.getuid() or found.st_mode & 0o22:
        raise RankLaunchError(f"Device claims go in {folder}, which is {what}; expected a folder of your own"
                              f" (uid {os.getuid()}), writable by you only. Remove it, or set"
                              f" {_CLAIMS_ENV}=<dir> (off: no claims).")  # fmt: skip
    return folder


def _claim(folder: Path, kind: str, inventory: list, count: int, job: contextlib.ExitStack) -> list:
    """``count`` devices of ``inventory`` (their names, of ``kind``) that no other running job holds: their
    positions in it. The open files whose locks hold them are closed as ``job`` (the job's ExitStack)
    closes, which lets go of them, and so does the kernel when the process ends, however it ends (SIGKILL
    included): a claim cannot outlive its job's rank 0. One job claims at a time (the queue's lock), so
    that two jobs never each take part of what both need and then wait for each other."""
    if count > len(inventory):
        raise RankLaunchError(f"This job asks for {count} {kind}s, and hydra_fsdp's jobs may use"
                              f" {len(inventory)} on this node ({', '.join(inventory)}): ask for fewer, or"
                              f" allow more ({_GPUS_ENV}; for cores, CPU affinity).")  # fmt: skip
    with os.fdopen(os.open(folder / f"{kind}.queue", os.O_RDWR | os.O_CREAT, 0o600)) as queue:
        # Waits in the kernel, and a signal interrupts it; bounded by the claims of the jobs ahead, each
        # bounded by the lives of the devices' holders (the kernel lets go of a lock when its holder ends).
        fcntl.flock(queue, fcntl.LOCK_EX)
        return _claim_in_turn(folder, kind, inventory, count, job)


def _claim_in_turn(folder: Path, kind: str, inventory: list, count: int, job: contextlib.ExitStack) -> list:
    """Each device is a file whose ``flock`` its holder keeps. Take free ones until ``count`` are held; where
    too few are free, say once what the job waits for and look again every ``_CLAIM_POLL`` s (the queue keeps
    other claimers out meanwhile; each holder lets go as its job ends). Whatever raises (a signal in the
    wait), every file opened here is closed, its lock with it; the claim's close as ``job`` does."""
    paths = [folder / f"{kind}{name}.lock" for name in inventory]
    files, held, claimed = [], [], False
    try:
        files.extend(os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in paths)  # one by one
        for looked in itertools.count():
            held += [index for index, fd in enumerate(files) if index not in held and _locked_now(fd)]
            if len(held) >= count:
                break
            if not looked:
                busy = [index for index in range(len(files)) if index not in held]
                holders = sorted({paths[index].read_text().strip() for index in busy} - {""})
                log.warning(f"hydra_fsdp: this job waits for {count} free {kind}s of {', '.join(inventory)}:"
                            f" {', '.join(inventory[index] for index in busy)} are held by other running jobs"
                            f" (pid {', '.join(holders)}). It starts as soon as enough are"
                            " free.")  # fmt: skip
            time.sleep(_CLAIM_POLL)
        held = sorted(held[:count])
        for index in held:  # for a job that waits to name who holds it
            os.ftruncate(files[index], 0)
            os.pwrite(files[index], f"{os.getpid()}\n".encode(), 0)
        for index in held:
            job.callback(os.close, files[index])
        claimed = True
        return held
    finally:
        for index, fd in enumerate(files):
            if not (claimed and index in held):
                os.close(fd)


def _locked_now(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class _Placement(NamedTuple):
    """Where a job's ranks run: the GPUs the job holds (None: as Lightning maps ``devices``), each rank's
    CPU cores (None: not pinned) and the threads each rank runs."""

    gpus: list | None
    cores: list
    threads: int


def _placement(spec: "_LaunchSpec", job: contextlib.ExitStack) -> _Placement:
    """Claim what the job runs on, held until ``job`` (the job's ExitStack) closes. On CUDA, ``devices=N``
    (Lightning's cuda:0..N-1) becomes N GPUs no other running job holds, any other list of GPUs is used as
    given, and a rank runs its GPU's share of the cores as threads. On the CPU the job claims its share of
    the cores (``_cores_per_job``), split among its ranks. With claiming off, each job splits all cores
    among its ranks, as Lightning's own launcher does."""
    cores, folder, world = sorted(os.sched_getaffinity(0)), _claims_folder(), spec.world_size
    unclaimed = _Placement(None, [None] * world, max(1, len(cores) // world))
    if spec.devices[0].type == "cuda":
        if folder is None or [device.index for device in spec.devices] != list(range(world)):
            return unclaimed
        inventory = _gpu_inventory()
        claimed = _claim(folder, "gpu", list(inventory.values()), world, job)
        gpus = [list(inventory)[index] for index in claimed]
        return _Placement(gpus, [None] * world, max(1, len(cores) // len(inventory)))
    if folder is None or spec.devices[0].type != "cpu":  # another accelerator: as Lightning has it
        return unclaimed
    claimed = _claim(folder, "cpu", [str(core) for core in cores], _cores_per_job(len(cores)), job)
    held = [cores[index] for index in claimed]
    share = len(held) // world  # none where the job has fewer cores than ranks: they share them
    ranks_cores = [held[r * share : (r + 1) * share] if share else held for r in range(world)]
    return _Placement(None, ranks_cores, max(1, share))


def _gpu_inventory() -> dict:
    """The GPUs a sweep's jobs may claim (``HYDRA_FSDP_GPUS``, else all), by torch's number: the name that
    the claim uses, the same in every process of the node (CUDA_VISIBLE_DEVICES renumbers them)."""
    count, allowed = torch.cuda.device_count(), os.environ.get(_GPUS_ENV, "")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",")[:count] if visible else [str(index) for index in range(count)]
    with contextlib.suppress(ValueError):  # not numbers: the same error as numbers out of range
        indexes = [int(index) for index in allowed.split(",")] if allowed else range(count)
        if all(0 <= index < count for index in indexes):
            return {index: names[index] for index in indexes}
    raise RankLaunchError(f"{_GPUS_ENV}={allowed!r}: expected numbers below the {count} torch sees, e.g. 0,1")


def _cores_per_job(cores: int) -> int:
    """How many of ``cores`` a job on the CPU claims: ``cpus_per_task`` where submitit's launcher states it,
    the CPUs Ray reserves for the job's task under hydra-ray-launcher (``ray.remote.num_cpus``, else Ray's
    default of 1; at most ``cores``), else its share by the number of jobs the joblib launcher runs at once
    (``n_jobs``; negative as joblib reads it), else all of them: such a launcher (Hydra's basic one) runs
    one job at a time."""
    launcher = HydraConfig.get().get("launcher") or {}
    if "ray" in launcher:  # Ray runs as many jobs at once as their num_cpus fit in its CPUs, and pins none
        return min(cores, max(1, int((launcher["ray"].get("remote") or {}).get("num_cpus") or 1)))
    if launcher.get("cpus_per_task"):
        return int(launcher["cpus_per_task"])
    n_jobs = launcher.get("n_jobs")
    if isinstance(n_jobs, int) and n_jobs != 0:
        return max(1, cores // (n_jobs if n_jobs > 0 else max(1, (os.cpu_count() or 1) + 1 + n_jobs)))
    return cores


def _users_threads() -> bool:
    """Whether ``OMP_NUM_THREADS`` is set, and by the user (it stands), not by Ray."""
    # Ray sets it in a worker's os.environ as each task starts, to the task's num_cpus, only where the
    # worker's environment lacks it, and pops it as the task ends (ray 2.60: python/ray/_raylet.pyx's
    # execute_task, through ray._private.utils.set_omp_num_threads_if_unset). A user's is in the environment
    # the worker process started with (the driver's, which a local Ray's workers inherit, `ray start`'s, or
    # runtime_env's env_vars: measured), which /proc/self/environ keeps as it was: Ray's is never there.
    if "OMP_NUM_THREADS" not in os.environ or "ray" not in (HydraConfig.get().get("launcher") or {}):
        return "OMP_NUM_THREADS" in os.environ
    return b"\0OMP_NUM_THREADS=" in b"\0" + Path("/proc/self/environ").read_bytes()


def _pin(cores: Any) -> None:
    """Run every thread of this process on ``cores``, those started earlier (torch's) too: setting the
    process's own affinity would change only the calling thread's and those it starts later."""
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(int(thread), cores)


# -------------------- rank 0's sweep and job
# Rank 0 is the sweep's process: it runs every job's rank 0, so whatever a job leaves behind (a process
# group, memory, a thread, a changed environment) every later job inherits. So each job's end undoes what
# the job did: it ends its child ranks, destroys its process groups, frees its memory, restores rank 0's
# environment, threads and cores, and lets go of the devices it claimed.

# ---------- what lasts from job to job


class _LaunchSpec(NamedTuple):
    """What starting a job's child ranks takes from its strategy."""

    world_size: int
    devices: tuple  # Lightning's devices for the ranks (cuda:0..N-1 for devices=N)
    address: str
    lightning: str
    rank_timeout: float
    module_key: str
    datamodule_key: str
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE  # on SIGINT or SIGTERM: the children's, before SIGKILL


class _Sweep(Callback):
    """What rank 0, the sweep's process, keeps from job to job (``_sweep``), and the Hydra callback that
    follows the jobs: a job's start freezes what is alive (its end's collection skips it), its end ends its
    ranks and frees what it held, the sweep's end ends the fork server. Only ``said`` is shared. (A job's
    ranks start at its first stage: forks of the fork server are up in a tenth of a second.)"""

    def __init__(self) -> None:
        self.said = threading.Condition()  # notified whenever the fork server says something
        self.fork_server: _ForkServer | None = None
        self.job: _Job | None = None  # whose child ranks run, from its first stage until Hydra ends it
        self.wrapped: list = []  # the FSDP wrappers the running job built, for its end to free
        self.ran: Any = None  # the JobReturn of the last job these strategies ran a stage of
        self.froze = False

    def job_for(self, spec: _LaunchSpec, hydra_job: dict | None) -> "_Job":
        """The job's ranks for a stage of ``spec``: those its first stage started, if alike."""
        if hydra_job is None or not HydraConfig.initialized():
            raise RankLaunchError("Child ranks start from the Hydra job's config; no Hydra job runs here:"
                                  " call trainer.fit/... in a Hydra task function (@hydra.main, hydra_zen),"
                                  " or use Lightning's own strategy.")  # fmt: skip
        if (job := self.job) is not None and job.job_return is hydra_job.get("ret"):
            if job.spec == spec:
                return job
            if job.released:
                raise RankLaunchError(f"This job's ranks run world size {job.spec.world_size}; a Trainer of"
                                      f" it now asks for {spec.world_size}: give each the same devices,"
                                      " num_nodes and strategy arguments.")  # fmt: skip
        return self.start_job(spec, hydra_job)

    def start_job(self, spec: _LaunchSpec, hydra_job: dict) -> "_Job":
        _register_at_exit()
        if self.job is not None:  # a job Hydra never ended (it raised past run_job), or one not alike
            self.job.close()
        self.job = _Job(self, spec, hydra_job)
        try:
            self.job.launch(hydra_job)
        except BaseException:
            self.job.close()
            raise
        return self.job

    def started_fork_server(self, lightning: str) -> _ForkServer:
        if self.fork_server is None or self.fork_server.proc.poll() is not None:
            self.fork_server = _ForkServer(lightning, HydraConfig.get().job.env_set).listen(self.said)
        return self.fork_server

    def new_store(self, address: str) -> torch.distributed.TCPStore:
        """A job's store, which init_process_group finds by its port in torch's cache of stores. That cache
        keeps the first store of each port, a dead one too (an earlier job's, whose port the OS offers
        again), until a lookup of that port by its number drops it: the store is opened by its number,
        where init_process_group would otherwise start a second server (EADDRINUSE)."""
        store = functools.partial(torch.distributed.TCPStore, address, is_master=True, wait_for_workers=False)
        while True:
            # a free port, free again as the store that found it goes (unless another process takes it: then
            # another one)
            port = store(0).port
            with contextlib.suppress(torch.distributed.DistNetworkError):
                return store(port, multi_tenant=True)

    def follow(self, hydra_context: Any) -> "_Sweep":
        # Hydra's Callbacks (private): the only way to its job ends without the user's config.
        callbacks = getattr(getattr(hydra_context, "callbacks", None), "callbacks", None)
        if not isinstance(callbacks, list):
            raise _upstream_changed("hydra_context.callbacks.callbacks, a list", "follow Hydra's jobs")
        if self not in callbacks:
            callbacks.append(self)
        return self

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        # What was alive before the job, frozen, is not scanned by its end's collection (most of a second).
        if gc.get_freeze_count() == 0:  # not over a user's freeze, or the last job's (it raised past its end)
            gc.freeze()
            self.froze = True

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        try:  # Hydra makes an error here a warning: what the job held must be let go of all the same
            if self.job is not None and self.job.job_return is job_return:
                self.job.finish(job_return)
        finally:
            if self.ran is job_return:
                self.ran = None
                _let_go_of_the_job(job_return, self.wrapped)
            if self.froze:
                gc.unfreeze()
                self.froze = False

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.fork_server is not None:
            self.fork_server.close()
            self.fork_server = None

    on_multirun_end = on_run_end


_sweep = _Sweep()


# ---------- a job's child ranks, and their failures


class _StageAbort:
    """Whether the job's process groups were aborted, and for which child: the fork server's thread
    aborts, the main thread runs the stage; one lock, so that no abort comes after the stage."""

    def __init__(self, store_port: int) -> None:
        self.store_port, self.lock = store_port, threading.Lock()
        self.in_stage, self.aborted = False, False  # aborted: a collective after it fails at once
        self.for_rank: int | None = None  # the child whose exit aborted them: no checkpoint after it

    @contextlib.contextmanager
    def stage(self) -> Any:
        self.in_stage = True  # an abort that reads False is one for no stage: it aborts nothing
        try:
            yield
        finally:
            self.end()

    def end(self) -> None:
        """No abort after this: the lock is held only by an abort under way, waited for ``_KILL_WAIT`` s at
        most. NCCL's abort can block (a communicator stuck in a kernel): the job then ends all the same (no
        later abort starts: one waiting for the lock finds the stage over), its abort left to its thread."""
        locked = self.lock.acquire(timeout=_KILL_WAIT)
        self.in_stage = False
        if locked:
            self.lock.release()

    def abort(self, for_rank: int | None = None) -> None:
        """For a child that failed (``for_rank``) while a stage runs: NCCL would wait for it until the
        group's timeout; for rank 0's failed stage: its exception hooks' collectives would wait too."""
        with self.lock:
            # Once; and for a child only while a stage runs (between stages no collective waits for it).
            if not self.aborted and (for_rank is None or self.in_stage):
                self.aborted = True
                if for_rank is not None:
                    self.for_rank = for_rank
                _abort_groups()
                if for_rank is not None and not torch.distributed.is_initialized():
                    _hang_up_on({self.store_port})  # rank 0 may wait for the dead child in init_process_group


def _hang_up_on(ports: set) -> None:
    """Shut this process's TCP connections to ``ports``, so that a wait on them fails at once. Rank 0's to
    the job's store, for a child that died as the ranks met, in init_process_group, inside torch's C++ store,
    where no Python code runs and no process group exists yet to abort; it would last the group's timeout
    (30 minutes by default). Not ended: a wait in NCCL's own bootstrap, and one on a connection made after
    this. And on SIGINT or SIGTERM rank 0's to its children's ports (``_ports_of``): gloo's pairs, so that no
    child stays blocked in a collective that waits for rank 0 (where its signal handler never runs) until
    the grace ends; neither a gloo group's abort nor its destroy, while DDP holds it, closes them.

    By C calls on the descriptors: a socket object made of one sets it non-blocking where a default
    timeout is set (socket.setdefaulttimeout), under whoever owns it."""
    libc = ctypes.CDLL(None, use_errno=True)
    peer, size = ctypes.create_string_buffer(28), ctypes.c_uint32()  # sockaddr_in6, the larger
    for fd in map(int, os.listdir("/proc/self/fd")):
        size.value = len(peer)
        if libc.getpeername(fd, peer, ctypes.byref(size)) == 0:  # a connected socket
            family = int.from_bytes(peer.raw[:2], sys.byteorder)
            if family in (socket.AF_INET, socket.AF_INET6) and int.from_bytes(peer.raw[2:4], "big") in ports:
                libc.shutdown(fd, socket.SHUT_RDWR)


def _ports_of(pids: list) -> set:
    """The local ports of the TCP sockets that processes ``pids`` (of this user) hold, from /proc."""
    sockets = set()
    for pid in pids:
        with contextlib.suppress(OSError):  # it exited
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):  # closed as it was read
                    sockets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    tables = [Path(table) for table in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(table)]
    rows = [line.split() for table in tables for line in table.read_text().splitlines()[1:]]
    return {int(row[1].rpartition(":")[2], 16) for row in rows if f"socket:[{row[9]}]" in sockets}


class _ChildRanks:
    """A job's child ranks: added as they start, stopped by a signal from any thread, ended with every wait
    bounded, described by their logs. The one place where both routes end a job's ranks, in the shape of
    torch elastic's ``PContext.close``: on SIGINT or SIGTERM the signal to each child once, a grace for all to
    exit (their graceful shutdown), then SIGKILL to the rest (``stop``, ``end``, ``close``); on a failure or
    a timeout, SIGKILL at once (``end``)."""

    def __init__(self, job_dir: Path, said: threading.Condition) -> None:
        self.job_dir, self.said, self.procs = job_dir, said, {}
        # A signal stops them from its thread, or from a handler on the main thread while it adds one.
        # Held only while a kill is written to the fork server (proc.kill: one write to a pipe).
        self.lock = threading.RLock()
        self.stopped_by: int | None = None  # the signal that stopped them
        # ranks that outlived SIGKILL: not waited for again; ranks still running at the grace's end
        self.unkillable, self.killed = set(), set()

    def add(self, rank: int, proc: Any) -> None:
        with self.lock:
            self.procs[rank] = proc
            if self.stopped_by is not None:
                proc.kill()

    def stop(self, signum: int, grace: float, again: bool = False) -> None:
        """SIGTERM or SIGINT (``signum``) reached the process that started them, from whichever thread. The
        first to say so (the signal watch thread, Lightning's SIGTERM handler, ``close``: one signal often
        comes by two of them) sends it on to every child, once; hangs up this process's connections to them
        (``_hang_up_on``); and starts a thread that ends them ``grace`` s later (``end``), even while the
        caller is blocked (rank 0's main thread in a collective). ``again``: a second signal (a second
        Ctrl-C), which only the watch thread counts: SIGKILL to every child at once."""
        with self.lock:
            first = self.stopped_by is None
            if first:
                self.deadline, self.stopped_by = time.monotonic() + grace, signum  # read unlocked by end
            self.killed.update(self.running() if again else ())
            for proc in list(self.procs.values()) if first or again else ():
                proc.send_signal(signum if first else signal.SIGKILL)
        if first:
            _hang_up_on(_ports_of([proc.pid for proc in list(self.procs.values())]))
            threading.Thread(target=self.end, name="hydra-fsdp-grace", daemon=True).start()

    def close(self, signum: int, grace: float) -> list:
        """End them as torch elastic's ``PContext.close`` does: ``signum`` to every child (``stop``), up to
        ``grace`` s for all to exit (their graceful shutdown: Lightning's ``on_exception`` hooks, its
        loggers' finalize), then SIGKILL to the rest (``end``), which it returns; a second signal cuts the
        grace short. A second Ctrl-C's KeyboardInterrupt here (the caller's main thread) does too: it ends
        them at once (as the watch thread, where there is one, already did), and the caller goes on."""
        self.stop(signum, grace)
        try:
            self.end()
        except KeyboardInterrupt:
            self.stop(signum, grace, again=True)
            self.end()
        return sorted(self.killed)

    def end(self) -> None:
        """SIGKILL every child still running and reap it, each wait bounded as torch elastic's: a child the
        kernel holds (uninterruptible sleep) is left to the fork server, and the sweep goes on. Once a signal
        stopped them, not before the grace it gave them ends (``stop``): whoever ends them, it holds."""
        if self.stopped_by is not None:
            _wait_until(self.said, lambda: not self.running(), self.deadline - time.monotonic())
            self.killed.update(self.running())
        for proc in list(self.procs.values()):
            proc.kill()
        deadline = time.monotonic() + _KILL_WAIT
        for rank, proc in list(self.procs.items()):
            try:
                if rank not in self.unkillable:
                    proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.unkillable.add(rank)
                log.warning(f"hydra_fsdp: child rank {rank} (pid {proc.pid}) is still there {_KILL_WAIT:g} s"
                            " after SIGKILL (uninterruptible sleep: a hung driver or file system?); the sweep"
                            " goes on.")  # fmt: skip

    def log(self, rank: int) -> Path:
        return self.job_dir / f"rank_{rank}.log"

    def running(self) -> list:
        return [rank for rank, proc in list(self.procs.items()) if proc.poll() is None]

    def first_failed(self) -> int | None:
        return next((rank for rank, proc in self.procs.items() if proc.poll() not in (None, 0)), None)

    def settled(self) -> bool:
        """Whether the job's outcome is known: every child exited, or one failed."""
        return not self.running() or self.first_failed() is not None

    def raise_if_any_exited(self) -> None:
        """While rank 0 runs the job's stages, every child must run."""
        for rank, proc in self.procs.items():
            if (code := proc.poll()) is not None:
                self.end()
                if code != 0:
                    raise self.failure(rank)
                raise ChildRankError(f"Child rank {rank} finished the job's task function while rank 0 still"
                                     " runs it, at a stage the child never reached (it took another path)."
                                     f" {self.describe(rank)}")  # fmt: skip

    def wait_until_exited(self, timeout: float) -> ChildRankError | None:
        """Wait for every child to finish the job: the job's error if one failed or would not."""
        if not _wait_until(self.said, self.settled, timeout):
            late = self.running()
            self.end()
            return ChildRankError(f"Child rank(s) {late} were still running {timeout:g} s after rank 0"
                                  f" finished the job: ended. {self.describe(late[0])}")  # fmt: skip
        failed = self.first_failed()
        return None if failed is None else self.failure(failed)

    def end_saying_where_they_stood(self, error: BaseException | None, why: str) -> None:
        """Have every running child dump its stack to its log, end them, and say so under ``error``, after
        ``why``."""
        if not (running := self.running()):
            return
        for rank in running:
            self.procs[rank].send_signal(_STACK_DUMP_SIGNAL)
        time.sleep(_STACK_DUMP_WAIT)
        self.end()
        _add_note(error, f"{why} they were ended:\n" + "\n".join(self.describe(rank) for rank in running))

    def failure(self, rank: int) -> ChildRankError:
        return ChildRankError(f"Child rank {rank} failed: {self.describe(rank)}")

    def describe(self, rank: int) -> str:
        proc = self.procs[rank]
        code = proc.poll()
        status = "still running" if code is None else _exit_status(code)
        if code is not None and isinstance(proc, _ForkedChild) and proc.pid not in proc.server.exit_codes:
            status = f"ended with the fork server (pid {proc.server.proc.pid})"  # not a failure of its own
        excerpt = "\n".join("    " + line for line in _log_excerpt(self.log(rank)))
        ending = f", ending with:\n{excerpt}" if excerpt else "."
        return f"rank {rank} (pid {proc.pid}, {status}); its log is {self.log(rank)}{ending}"


def _log_excerpt(log_path: Path) -> list[str]:
    """The end of a child's log or, if its stack was dumped before it was ended, where it stood. Only the
    log's last ``_LOG_TAIL_BYTES`` are read, since a rank's log can be gigabytes long."""
    if not log_path.exists():
        return []
    with open(log_path, "rb") as log_file:
        start = max(0, log_file.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES)
        log_file.seek(start)
        lines = log_file.read().decode(errors="replace").splitlines()[1 if start else 0 :]  # whole lines
    dumps = [i for i, line in enumerate(lines) if line.endswith("(most recent call first):")]
    for start, end in reversed(list(zip(dumps, dumps[1:] + [len(lines)]))):
        if any("_run_child_rank" in line for line in lines[start:end]):
            return lines[start : start + _LOG_TAIL_LINES]
    return lines[-_LOG_TAIL_LINES:]


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+: printed under the traceback
        error.add_note(note)
    else:
        print(note, file=sys.stderr)


# ---------- the job


class _Job:
    """Rank 0's side of one Hydra job: its child ranks, store and process group, from its first stage until
    Hydra ends it (``finish``), so that all its stages run on one set of ranks. ``close`` undoes what the
    job did, the last first, however it ended."""

    def __init__(self, sweep: _Sweep, spec: _LaunchSpec, hydra_job: dict) -> None:
        self.sweep, self.spec, self.started = sweep, spec, time.monotonic()
        self.job_return = hydra_job["ret"]
        self.children = _ChildRanks(Path(HydraConfig.get().runtime.output_dir), sweep.said)
        self.released = False  # the children were told to run the job (_GO_KEY)
        self.runs_task, self.stages_announced = True, 0
        self.error: BaseException | None = None  # the job's, decided once, where it happened (error_for)
        self.closing = contextlib.ExitStack()
        self.close = self.closing.close  # undo what the job did, the last first (or _at_exit does)
        self.closing.callback(self._forget)
        self.closing.callback(_restore_environ, {key: os.environ.get(key) for key in _JOB_ENV})
        self.store = sweep.new_store(spec.address)
        self.abort = _StageAbort(self.store.port)
        os.environ["MASTER_PORT"] = str(self.store.port)
        stop = functools.partial(self.children.stop, grace=spec.shutdown_grace)
        self.closing.callback(_SignalWatch(stop).close)
        self.closing.callback(lambda: _destroy_process_group(aborted=self.abort.aborted))
        self.closing.callback((self.children.job_dir / _LAUNCH_FILE).unlink, missing_ok=True)
        self.closing.callback(self.children.end)

    def launch(self, hydra_job: dict) -> None:
        # Rank 0 runs on the job's own cores and threads, and gets its own back after the job.
        self.closing.callback(torch.set_num_threads, torch.get_num_threads())
        self.closing.callback(_pin, os.sched_getaffinity(0))
        self.placement = _placement(self.spec, self.closing)
        if self.placement.cores[0] is not None:
            _pin(self.placement.cores[0])
        if not _users_threads():  # a user's value stands
            torch.set_num_threads(self.placement.threads)
            os.environ["OMP_NUM_THREADS"] = str(self.placement.threads)
        self.sweep.follow(hydra_job["hydra_context"])
        self.runs_task = _rank_launch(self, hydra_job)
        for key, value in _NCCL_KEEPS_THE_PROCESS.items():  # rank 0's own: the children keep torch's
            if key.removeprefix("TORCH_") not in os.environ:  # nor set under its legacy name
                os.environ.setdefault(key, value)

    def begin_stage(self, trainer: Any, call: dict) -> None:
        """Before rank 0 runs a stage: children alive, released, told the stage (fallback), checked in."""
        self.children.raise_if_any_exited()
        if not self.runs_task:
            self.store.set(_STAGE_KEY.format(self.stages_announced), _stage_for_children(trainer, call))
            self.stages_announced += 1
        if not self.released:
            self.store.set(_GO_KEY, "1")
            self.released = True
            self.wait_until_checked_in()

    @contextlib.contextmanager
    def stage(self) -> Any:
        """While rank 0 runs a stage: a child's failure aborts it (``_StageAbort.abort``), and then the stage
        fails with the child's error even if the abort released rank 0 without one."""
        with self.abort.stage():
            yield
        self.raise_if_aborted()

    def raise_if_aborted(self) -> None:
        if self.abort.for_rank is not None:
            self.children.end()
            raise self.children.failure(self.abort.for_rank)

    def wait_until_checked_in(self) -> None:
        """Wait until every child is about to join the process group; fail fast if one cannot."""
        keys = {rank: _CHECK_IN_KEY.format(rank) for rank in self.children.procs}

        def checked_in_or_exited() -> bool:  # one that exited: raise_if_any_exited below says which
            return self.store.check(list(keys.values())) or len(self.children.running()) < len(keys)

        if not _wait_until(self.children.said, checked_in_or_exited, self.spec.rank_timeout):
            late = [rank for rank, key in keys.items() if not self.store.check([key])]
            self.children.end()
            raise ChildRankError(f"Child rank(s) {late} did not reach the process group within"
                                 f" {self.spec.rank_timeout:g} s and were ended."
                                 f" {self.children.describe(late[0])} Raise rank_timeout if they start"
                                 " slowly.")  # fmt: skip
        self.children.raise_if_any_exited()

    def error_for(self, error: BaseException) -> BaseException:
        """The error a stage that raised on rank 0 fails the job with; the children are ended. Decided once:
        at the job's end the children it ended have exited killed, which is no failure of theirs. On SIGINT
        or SIGTERM the children first get the grace (``_ChildRanks.close``), and the job ends the sweep as
        the signal does (130, 143), saying so as the launcher's jobs do (``_interruption``)."""
        signum = self.children.stopped_by
        if signum is None and isinstance(error, KeyboardInterrupt):
            # Ctrl-C, its handler first to run (Lightning < 2.3 swallows it: the sweep would go on).
            signum = signal.SIGINT
        if signum is not None:
            killed = self.children.close(signum, self.spec.shutdown_grace)
            log.error(f"hydra_fsdp: {_interruption(signum, time.monotonic() - self.started, killed)}")
            error = SystemExit(128 + signum)
        elif not isinstance(error, (ChildRankError, RankLaunchError, KeyboardInterrupt, SystemExit)):
            # a collective that failed because a child failed: the child's error is the job's
            _wait_until(self.children.said, self.children.settled, _PEER_EXIT_GRACE)
            self.abort.for_rank = self.children.first_failed()
            if self.abort.for_rank is not None:
                failure = self.children.failure(self.abort.for_rank)
                failure.__cause__, error = error, failure
            else:  # rank 0's own error, or a collective that timed out on a child that hangs
                why = "Rank 0 failed while these child ranks were still running;"
                self.children.end_saying_where_they_stood(error, why)
        self.children.end()
        self.abort.abort()
        self.error = error
        return error

    def finish(self, job_return: Any) -> None:
        """Hydra ended the job: a child's late failure fails it; clean up."""
        try:
            if not self.released:  # its first stage failed before the children were told to run: nor did they
                return
            if job_return.status is JobStatus.COMPLETED:
                if not self.runs_task:
                    self.store.set(_STAGE_KEY.format(self.stages_announced), "null")
                # a child still in a collective with rank 0 fails at once, instead of waiting; and no
                # child's late failure aborts what this destroys (Fabric's stage lasts until close)
                self.abort.end()
                _destroy_process_group()
                if (failure := self.children.wait_until_exited(self.spec.rank_timeout)) is not None:
                    job_return.status = JobStatus.FAILED
                    job_return.return_value = failure
            elif self.error is None:  # rank 0 failed outside a stage (the public getter prints Hydra's line)
                # a child's failure that caused it (a collective that broke) is the job's error
                job_return.return_value = self.error_for(getattr(job_return, "_return_value", None))
        finally:
            self.close()

    def _forget(self) -> None:
        if self.sweep.job is self:
            self.sweep.job = None
        if self.abort.aborted and torch.cuda.is_initialized():
            try:  # a peer that died mid-transfer (NVLink), or rank 0's own fault, can leave it broken
                torch.cuda.synchronize()
            except RuntimeError as error:
                raise SystemExit("hydra_fsdp: rank 0's CUDA is unusable after this job failed and its process"
                                 f" groups were aborted ({error}). Every later job of the sweep would fail or"
                                 " run wrong, so the sweep stops here: start the process again (for the"
                                 " remaining jobs).") from error  # fmt: skip


def _restore_environ(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class _SignalWatch:
    """Stop the job's children the moment SIGTERM or SIGINT reaches rank 0: Python runs a handler only
    once the main thread is back in the interpreter, which one blocked in a collective never is, but the
    C handler writes the signal to the wakeup fd at once. This thread reads it and stops the children
    (``_ChildRanks.stop``: the signal once, then the grace), and on a second signal kills them."""

    watching: "_SignalWatch | None" = None  # the one running, which a fork of rank 0 drops (in_a_fork)
    forks_drop_it = False  # os.register_at_fork's hook: registered by the first watch, not at import

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self.thread, self.sigterm_was = None, None  # the watcher; SIGTERM's handler before the watch's
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers and the wakeup fd belong to the main thread
        if not _SignalWatch.forks_drop_it:  # here, not at import: importing hydra_fsdp has no side effects
            os.register_at_fork(after_in_child=_SignalWatch.in_a_fork)
            _SignalWatch.forks_drop_it = True
        read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        if previous_fd != -1:  # someone else's (an asyncio loop): leave it theirs
            signal.set_wakeup_fd(previous_fd)
            os.close(read_fd)
            os.close(self.write_fd)
            return
        _SignalWatch.watching = self
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # no Python handler: no wakeup byte
            self.sigterm_was = signal.signal(signal.SIGTERM, self.raise_system_exit)
        self.thread = threading.Thread(target=self._watch, args=(read_fd, on_signal),
                                       name="hydra-fsdp-signals", daemon=True)  # fmt: skip
        self.thread.start()

    @staticmethod
    def raise_system_exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    @staticmethod
    def _watch(read_fd: int, on_signal: Callable[..., None]) -> None:
        again = False
        with open(read_fd, "rb", buffering=0) as wakeups:
            while received := wakeups.read(64):  # b"" once every write end is closed
                for signum in received:
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        on_signal(signum, again=again)
                        again = True

    @staticmethod
    def in_a_fork() -> None:
        """A fork of rank 0 (a DataLoader worker, a Pool's) is not rank 0: a signal to it (torch's SIGTERM
        to a worker that does not join) would reach the watcher through the wakeup fd and end the job's
        ranks, and its copy of the pipe would keep close() waiting until it exits. It closes the watch
        (whose thread threading's own fork hook, which runs first, marked as ended)."""
        if _SignalWatch.watching is not None:
            _SignalWatch.watching.close()

    def close(self) -> None:
        if self.thread is None:
            return
        _SignalWatch.watching = None
        signal.set_wakeup_fd(-1)
        if self.sigterm_was is not None and signal.getsignal(signal.SIGTERM) is self.raise_system_exit:
            signal.signal(signal.SIGTERM, self.sigterm_was)
        os.close(self.write_fd)
        # The watcher ends once no write end is open, a fork's included (in_a_fork closes those): bounded
        # all the same, for a fork made past Python's (a C library's), which keeps its copy.
        self.thread.join(timeout=1.0)
        self.thread = None


def _stage_for_children(trainer: Any, call: dict) -> str:
    """The fallback: what children repeat of a stage rank 0 runs (Lightning resolves the checkpoint), as
    JSON for the store."""
    datamodule_class = trainer.strategy._lightning.LightningDataModule
    data = [call.get(name) for name in ("train_dataloaders", "val_dataloaders", "dataloaders", "datamodule")]
    stage = {"stage": trainer.state.fn.value, "ckpt_path": trainer.strategy._stage_ckpt_path}
    return json.dumps({**stage, "datamodule": any(isinstance(value, datamodule_class) for value in data)})


# ---------- a job's teardown: its process groups


def _destroy_process_group(aborted: bool = False) -> None:
    """Destroy the default process group, so that the next job of the sweep starts from none.
    ``aborted``: a child failed and the group's collectives were aborted (``_abort_groups``); from torch 2.7
    such a group is ended by torch's own ``_abort_process_group``, which a plain destroy would wait on.

    Neither this function nor its callers keep a local name for the group (``torch.distributed.group.WORLD``
    is read where it is used). Its last reference must go inside ``destroy_process_group``: one left in a
    frame goes when the frame ends, and on torch < 2.4 freeing a group there deadlocks (see below). A name
    kept here hung a job's end on torch 2.3 twice (2c850a0, undone in 1d76506 and again in d3aa01c)."""
    if not torch.distributed.is_available():
        return
    if aborted and hasattr(torch.distributed.group.WORLD, "abort"):  # torch >= 2.7
        abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
        if abort is None:
            raise _upstream_changed("torch's distributed_c10d._abort_process_group", "end an aborted group")
        abort(torch.distributed.group.WORLD)
    if torch.distributed.is_initialized():
        # Hold the group's backends while it is destroyed: torch < 2.4 frees the group holding the GIL, and
        # gloo's destructor waits for a worker thread that needs the GIL (6 of 20 runs hung on torch 2.3).
        # The backends, let go of after the destroy, are freed with the GIL released.
        backends = _backends_of(torch.distributed.group.WORLD)
        torch.distributed.destroy_process_group()
        del backends
    # A failed init_process_group counted a group it never made: the next job would wait for group "1".
    world = getattr(torch.distributed.distributed_c10d, "_world", None)
    if not isinstance(getattr(world, "group_count", None), int):
        raise _upstream_changed("torch's distributed_c10d._world.group_count", "reset its count of groups")
    world.group_count = 0


def _abort_groups() -> None:
    """Abort the job's process groups, from any thread, so that no collective waits for a child that
    failed: NCCL's would wait until the group's timeout. How depends on the torch release:

    - torch >= 2.7: every group has ``abort()``, and every group is aborted (a DeviceMesh has its own);
    - torch 2.6: the default group's NCCL backend has ``abort()``;
    - torch 2.3 to 2.5: the default group's NCCL backend has ``_shutdown()``.

    gloo needs none: its collectives fail as soon as the failed child's connections close. No local name
    holds the default group (see ``_destroy_process_group``).
    """
    if hasattr(torch.distributed.group.WORLD, "abort"):  # torch >= 2.7
        registry = getattr(torch.distributed.distributed_c10d, "_world", None)
        # NCCL's communicators aborted one by one can wait on each other (pytorch#119797): as one NCCL
        # group, as torch's own _abort_process_group does.
        nccl = [each for each in _backends_of(torch.distributed.group.WORLD) if hasattr(each, "_group_start")]
        for backend in nccl:
            backend._group_start()
        try:
            for group in list(getattr(registry, "pg_map", None) or [torch.distributed.group.WORLD]):
                group.abort()
        finally:
            for backend in nccl:
                backend._group_end()
        return
    for backend in _backends_of(torch.distributed.group.WORLD):
        if hasattr(backend, "abort"):  # torch 2.6
            backend.abort()
        elif hasattr(backend, "_shutdown"):  # torch 2.3 to 2.5
            backend._shutdown()
        elif type(backend).__name__ == "ProcessGroupNCCL":  # a torch that ends NCCL otherwise: say so
            log.warning("hydra_fsdp: no NCCL abort(): collectives on a failed child wait for their timeout.")


def _backends_of(group: Any) -> list:
    """The backends (gloo, NCCL) of ``group``, in a function of its own so that no reference to the group
    outlives its destroy (the last, let go of holding the GIL, would deadlock as above)."""
    try:
        return [group._get_backend(device) for device in group._device_types]
    except (AttributeError, RuntimeError):  # a torch that names them otherwise: destroy as before
        return []


def _at_exit() -> None:
    """hydra_fsdp's one exit hook, for rank 0 and every other rank: in order, a job still running (SIGTERM,
    Ctrl-C, a SystemExit that never reached Hydra's job end) ends by its own close, which knows whether its
    groups were aborted (a plain destroy of an aborted NCCL group can wait); the process groups are destroyed
    while the interpreter is whole (gloo's threads, alive while anything holds a group, an FSDP module in a
    cycle, abort the process at exit: SIGABRT); the fork server ends, and any child still running with it.
    Then the rest is frozen: the interpreter's own collections at exit need not scan it."""
    if _sweep.job is not None:
        _sweep.job.close()
    _destroy_process_group()
    if _sweep.fork_server is not None:
        _sweep.fork_server.close()
    gc.collect()
    gc.freeze()


def _register_at_exit() -> None:
    """Once, and again at each job's start and stage: the last registered runs first, before the exit
    hooks of what a job imported (torch's, a library's) run against groups still alive."""
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


# ---------- the memory a job held, freed between jobs


def _let_go_of_the_job(job_return: Any, wrapped: list) -> None:
    """Free what the job that just ended held here, where every later job runs: cyclic garbage, the
    FSDP wrappers' flat parameters, torch's caches, and a failed job's traceback (Hydra keeps
    it: its frames hold the module and optimizer). What the user's code can reach stays whole."""
    error = getattr(job_return, "_return_value", None) if job_return.status is JobStatus.FAILED else None
    # The frames go, their text stays (clearing the frames is not enough: a cleared frame holds its
    # function): under each error of the chain as a note, which Hydra prints with the error at the sweep's
    # end. Python 3.10 has no notes: there the whole chain is printed now, once, with its frames. hydra-core
    # 1.4 keeps the text itself (the job's _remote_traceback: files, functions, lines), and prints it with
    # the error where its traceback is gone: notes would show each frame twice. (Were that name gone in a
    # later Hydra, the notes would come back: twice, never lost.)
    text = error if getattr(job_return, "_remote_traceback", None) is None else None
    if isinstance(text, BaseException) and not hasattr(text, "add_note"):
        traceback.print_exception(type(text), text, text.__traceback__)
    # The error and every error it links to: a child's failure, never raised, has no traceback of its own,
    # and its cause (rank 0's broken collective) does; an error raised `from` another while handling a
    # third links to both (its __cause__ and __context__), and each one's frames hold the job's objects.
    pending, chain = [error], []
    while pending:
        error = pending.pop()
        if not isinstance(error, BaseException) or any(error is seen for seen in chain):
            continue
        chain.append(error)
        if text is not None and hasattr(error, "add_note") and error.__traceback__ is not None:
            error.add_note(
                "Traceback (most recent call last):\n" + "".join(traceback.format_tb(error.__traceback__))
            )
        error.__traceback__ = None
        pending += [error.__cause__, error.__context__]
    while wrapped:  # the FSDP wrappers the job built
        _free_flat_parameters(wrapped.pop())
    _clear_torch_caches()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# The DTensor caches keep the first job's DeviceMesh, and through it its process groups, for good: a later
# job's mesh compares equal to it, so the old entry is found and kept (the sharding propagator's, in Python
# and in C++, the redistribute planners', the transform plans' and the mesh topology's; torch 2.13 has all
# of them). torch 2.4 to 2.7 also cache _get_fqns by model, which keeps every FSDP2 job's whole model.
# Each is a module and the dotted name, in it, of the function that clears the cache.
_TORCH_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_python_sharding_prop_cache"),
    ("torch.distributed.tensor.debug", "_clear_fast_path_sharding_prop_cache"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
    ("torch.distributed.checkpoint.state_dict", "_get_fqns.cache_clear"),
)


def _clear_torch_caches() -> None:
    """Clear torch's caches that keep a finished job's objects (``_TORCH_CACHES``), each only where its
    package was imported (else it holds nothing) and where this torch release has it."""
    for module, name in _TORCH_CACHES:
        if module.rpartition(".")[0] in sys.modules:
            try:
                clear = operator.attrgetter(name)(importlib.import_module(module))
            except (ImportError, AttributeError):  # not in this torch release
                continue
            clear()


def _free_flat_parameters(wrapper: torch.nn.Module) -> None:
    """Let ``wrapper``'s flat parameters be freed: one refers to the modules it flattened (torch
    >= 2.13) and to a hook a failed step left, and both edges back go through C++, where gc sees no cycle."""
    for unit in _fsdp().FullyShardedDataParallel.fsdp_modules(wrapper):
        flat_param = getattr(getattr(unit, "_handle", None), "flat_param", None)
        if flat_param is None and hasattr(unit, "_handle"):
            continue  # a unit that holds no parameters of its own
        if not isinstance(flat_param, torch.nn.Parameter):
            raise _upstream_changed("FSDP's FlatParamHandle.flat_param", "free a job's flat parameters")
        for value in flat_param.__dict__.values():  # a post-backward hook a failed step left registered
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, torch.utils.hooks.RemovableHandle):
                    item.remove()
        flat_param.__dict__.clear()


# ---------- the launcher that Lightning calls


class _HydraRankLauncher:
    """Start a job's child ranks from its config, never from ``sys.argv`` (which, under ``--multirun``, is
    the sweep): they run the job's task function, live as long as the job, and a failed one fails its job."""

    def __init__(self, strategy: "_HydraStrategy") -> None:
        self.strategy = strategy

    is_interactive_compatible = False  # it starts processes: not from a notebook (Lightning asks)

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = self.strategy
        call = inspect.signature(function).bind(*args, **kwargs).arguments
        # for the ranks to compare, and for the fallback's children to repeat
        strategy._stage_ckpt_path = None if call.get("ckpt_path") is None else str(call["ckpt_path"])
        env, hydra_job = strategy.cluster_environment, _hydra_job()
        if hydra_job is not None and "ret" in hydra_job:  # a long-lived process of the sweep: not a child
            _sweep.follow(hydra_job["hydra_context"]).ran = hydra_job["ret"]
        if env.creates_processes_externally:  # a child rank we started, or torchrun / SLURM
            if _CHILD_ENV in os.environ:
                gpus = os.environ.get(_JOB_GPUS_ENV)
                strategy._job_gpus = None if gpus is None else [int(gpu) for gpu in gpus.split(",")]
                _child_store().set(_CHECK_IN_KEY.format(os.environ["LOCAL_RANK"]), "1")
            else:
                _check_launched_world_size(strategy.num_nodes, strategy.num_processes)
            env.validate_settings(num_devices=strategy.num_processes, num_nodes=strategy.num_nodes)
            return function(*args, **kwargs)
        if strategy.num_nodes > 1:
            raise RankLaunchError(f"num_nodes={strategy.num_nodes}: hydra_fsdp starts ranks on 1 node; use"
                                  " torchrun or SLURM.")  # fmt: skip
        devices, lightning = tuple(strategy.parallel_devices), strategy._lightning.__name__
        spec = _LaunchSpec(strategy.world_size, devices, env.main_address, lightning, strategy.rank_timeout,
                           **strategy._config_keys, shutdown_grace=strategy.shutdown_grace)  # fmt: skip
        job = _sweep.job_for(spec, hydra_job)
        strategy._job_gpus = job.placement.gpus
        try:
            job.begin_stage(trainer, call)
            if trainer is None and not job.abort.in_stage:  # Fabric: from launch() to the job's end
                job.closing.enter_context(job.abort.stage())
            with job.stage() if trainer is not None else contextlib.nullcontext():
                return function(*args, **kwargs)
        except BaseException as error:
            job_error = job.error_for(error)
            if job_error is error:
                raise
            raise job_error from error

    def kill(self, signum: int) -> None:
        """Called by Lightning's SIGTERM handler (with SIGKILL for its own children on some releases): the
        job, and with it the sweep, is to stop, its children after their grace (``_ChildRanks.stop``)."""
        if (job := _sweep.job) is not None:
            job.children.stop(signal.SIGTERM, job.spec.shutdown_grace)


def _check_launched_world_size(num_nodes: int, devices: int) -> None:
    """Fail before the rendezvous, which would wait for ranks that never come."""
    launched = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS")
    if launched is not None and int(launched) != num_nodes * devices:
        raise RankLaunchError(
            f"The external launcher started {launched} processes (world size), but the strategy expects"
            f" num_nodes x devices = {num_nodes} x {devices} = {num_nodes * devices}. Run one per device per"
            " node (torchrun --nproc-per-node, SLURM --ntasks-per-node), or set num_nodes/devices to match."
        )


# -------------------- every rank agrees


def _check_ranks_agree(strategy: "_HydraStrategy") -> None:
    """Fail the stage on every rank if the ranks are about to run different things: different trainers
    (a callback on rank 0 alone) deadlock; different configs (``${now:...}`` under torchrun) split a job."""
    mine = _flat(_what_this_rank_runs(strategy))
    everyone: list = [None] * strategy.world_size
    torch.distributed.all_gather_object(everyone, mine)
    keys = {key for ran in everyone for key in ran}
    differing = sorted(key for key in keys if any(ran.get(key) != mine.get(key) for ran in everyone))
    if not differing:
        return

    def shown(rank: int, value: Any) -> str:
        return f"rank {rank} " + ("[" + ", ".join(value) + "]" if isinstance(value, list) else repr(value))

    differences = [
        f"  {key}: " + ", ".join(shown(rank, ran.get(key, "<missing>")) for rank, ran in enumerate(everyone))
        for key in differing[:_DIFFERENCES_SHOWN]
    ]
    more = len(differing) - _DIFFERENCES_SHOWN
    raise RankLaunchError(
        f"The ranks of this job are about to run different things in {mine['stage']}; they disagree on it:\n"
        + "\n".join(differences)
        + (f"\n  ... and {more} more" if more > 0 else "")
        + "\nBuild the same trainer (or Fabric), module and data on every rank, else they deadlock (no"
        " `if rank == 0` around callbacks or loggers). Under torchrun or SLURM each process resolves the"
        " config itself: no ${now:...} or random values in hydra.sweep.dir, hydra.run.dir or the config;"
        " use a value the launcher gives all alike, e.g. hydra.sweep.dir=multirun/${oc.env:SLURM_JOB_ID}."
    )


def _what_this_rank_runs(strategy: "_HydraStrategy") -> dict:
    """What this rank is about to run: the job, the strategy, and a Trainer's stage, parts and module, or the
    Fabric's precision (a Fabric has no stages: its ranks compare what they built as it launches)."""
    hydra_job = _hydra_job()
    output_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None
    seen = {
        "strategy": type(strategy).__qualname__,
        "devices": f"{strategy.num_nodes} x {strategy.num_processes}",
        "hydra.runtime.output_dir": output_dir,
        "config": None if hydra_job is None else _resolved_where_possible(hydra_job["task_cfg"]),
        "config types": None if hydra_job is None else _types_of(hydra_job["task_cfg"]),
    }
    if strategy._lightning.__name__.endswith("fabric"):
        precision = f"{type(strategy.precision).__qualname__} {strategy.precision.precision}"
        return {"stage": "fabric.launch()", "precision": precision, **seen}
    module, trainer = strategy.lightning_module, strategy.lightning_module.trainer
    # an FSDP module that ran a stage holds its shard: shapes differ by rank, by design
    full = strategy._holds_full_parameters()
    shapes = [(name, tuple(p.shape) if full else "sharded", p.dtype) for name, p in module.named_parameters()]
    # named: a dtype alone may differ (an earlier job's torch.set_default_dtype stays in rank 0, the sweep's)
    dtypes = "/".join(sorted({str(dtype).removeprefix("torch.") for *_, dtype in shapes}))
    settings = ["max_epochs", "max_steps", "accumulate_grad_batches", "precision"]
    settings += [f"limit_{loop}_batches" for loop in ("train", "val", "test", "predict")]
    return {
        "stage": f"trainer.{trainer.state.fn.value}()",
        "callbacks": sorted(type(callback).__qualname__ for callback in trainer.callbacks),
        "loggers": sorted(type(logger).__qualname__ for logger in trainer.loggers),
        **{name: getattr(trainer, name) for name in settings},
        "module": type(module).__qualname__,
        "module parameters": f"{len(shapes)} {dtypes} tensors"
        + (f" of {sum(p.numel() for p in module.parameters())} values" if full else " (sharded)")
        + f", shapes #{hashlib.sha1(repr(shapes).encode()).hexdigest()[:8]}",
        "datamodule": None if trainer.datamodule is None else type(trainer.datamodule).__qualname__,
        "ckpt_path": strategy._stage_ckpt_path,
        **seen,
    }


def _flat(tree: Any, prefix: str = "") -> dict:
    if isinstance(tree, dict) and tree:
        return {k: v for key, item in tree.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(tree, list) and tree and not all(isinstance(item, str) for item in tree):
        return {k: v for i, item in enumerate(tree) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


# -------------------- the strategies

# ---------- the releases each strategy needs


# The oldest releases, as pyproject.toml declares them: below them hydra_fsdp refuses to build a strategy.
# (lightning_fabric is checked as the pytorch-lightning whose wheel holds it)
_MINIMUM_VERSIONS = {"torch": "2.3", "hydra-core": "1.3.0", "pytorch-lightning": "2.2", "lightning": "2.2"}


class _Need(NamedTuple):
    """Releases that a strategy needs beyond hydra_fsdp's own floor, always or only where there is no GPU;
    None: any release."""

    strategy: str
    without_gpu: bool
    lightning: str | None
    torch: str | None


# Lightning refuses FSDP on a CPU before 2.3.0, and ModelParallelStrategy is new in Lightning 2.4. Without a
# GPU, FSDP2 trains right only from torch 2.10: before it, gloo's reduce_scatter with AVG sums instead
# (pytorch/pytorch#162338), so that gradients are N times too large, silently.
_NEEDS = (
    _Need("HydraFSDP", without_gpu=True, lightning="2.3.0", torch=None),
    _Need("HydraModelParallel", without_gpu=False, lightning="2.4", torch="2.4"),
    _Need("HydraModelParallel", without_gpu=True, lightning=None, torch="2.10"),
)


def _release(version: str) -> tuple:
    """A version's release numbers: "2.3.0+cu121" and "2.2.0.post0" give (2, 3, 0), (2, 2, 0)."""
    match = re.match(r"\d+(\.\d+)*", str(version))
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def _check_versions(lightning: types.ModuleType, strategy: str) -> None:
    """Refuse releases older than ``strategy`` runs on, naming what it needs."""
    import hydra

    package = lightning.__name__.split(".")[0]
    # its pip name: lightning_fabric ships in pytorch-lightning's wheel, at its release
    lightning_name = "pytorch-lightning" if package == "lightning_fabric" else package.replace("_", "-")
    found = {lightning_name: sys.modules[package].__version__}
    found |= {"torch": torch.__version__, "hydra-core": hydra.__version__}
    needs = [("hydra_fsdp", _MINIMUM_VERSIONS, "")]
    for need in _NEEDS:
        if need.strategy == strategy and not (need.without_gpu and torch.cuda.is_available()):
            who = strategy + (" without a GPU" if need.without_gpu else "")
            needs.append((who, {lightning_name: need.lightning, "torch": need.torch}, ", or use HydraDDP"))
    for who, need, otherwise in needs:
        too_old = [name for name in found if need.get(name) and _release(found[name]) < _release(need[name])]
        if too_old:
            what = ", ".join(f"{name}>={need[name]} (found {found[name]})" for name in too_old)
            install = " ".join(f"'{name}>={need[name]}'" for name in too_old)
            raise ImportError(f"{who} needs {what}: pip install {install}{otherwise}.")


def _fsdp() -> types.ModuleType:
    """torch.distributed.fsdp, imported on first use: half a second that importing hydra_fsdp does without."""
    return importlib.import_module("torch.distributed.fsdp")


# ---------- what every strategy adds to Lightning's


class _HydraStrategy:
    """What every strategy here adds to Lightning's, mixed in before it (``_lightning``: its namespace)."""

    _lightning: types.ModuleType

    def __init__(self, *args: Any, rank_timeout: float = DEFAULT_RANK_TIMEOUT, module_key: str = "module",
                 datamodule_key: str = "datamodule", shutdown_grace: float | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        if type(rank_timeout) is bool or not isinstance(rank_timeout, (int, float)) or not rank_timeout > 0:
            raise ValueError(f"rank_timeout={rank_timeout!r}: expected seconds > 0, e.g. 600 (the default).")
        # on SIGINT or SIGTERM, the seconds its child ranks have to exit before SIGKILL: this, else the
        # environment's MUSHIN_DDP_SHUTDOWN_GRACE, else 30
        if shutdown_grace is None:
            shutdown_grace = _launch_delay(SHUTDOWN_GRACE_ENV, DEFAULT_SHUTDOWN_GRACE)
        if type(shutdown_grace) not in (int, float) or not shutdown_grace >= 0:
            raise ValueError(f"shutdown_grace={shutdown_grace!r}: expected seconds >= 0, e.g. 30.")
        config_keys = {"module_key": module_key, "datamodule_key": datamodule_key}
        for name, key in config_keys.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"{name}={key!r}: expected the non-empty name of a key of the job's config.")
        _check_versions(self._lightning, type(self).__name__)
        super().__init__(*args, **kwargs)
        self.rank_timeout, self._config_keys, self.shutdown_grace = rank_timeout, config_keys, shutdown_grace
        self._stage_ckpt_path: str | None = None
        self._job_gpus: list | None = None  # the GPUs this rank's job holds, by rank (see _placement)

    @property
    def root_device(self) -> torch.device:
        if self._job_gpus is None:
            return super().root_device
        return torch.device("cuda", self._job_gpus[self.local_rank])

    @property
    def launcher(self) -> "_HydraRankLauncher":
        return _HydraRankLauncher(self)

    def __repr__(self) -> str:
        # A Trainer of the other namespace refuses the strategy by its repr: say which it takes.
        name = type(self).__name__
        spellings = [f"{__name__}.{ns}.{name} for a {package}.Trainer" for ns, package in _NAMESPACES.items()]
        return f"<{__name__}.{type(self).__qualname__}: use {' or '.join(spellings)}>"

    def setup_environment(self) -> None:
        if _sweep.job is not None:  # rank 0: not into init_process_group for a child that died
            _sweep.job.raise_if_aborted()
        super().setup_environment()
        _register_at_exit()
        if self.world_size > 1:
            _check_ranks_agree(self)

    def _holds_full_parameters(self) -> bool:
        return True

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        if _sweep.job is not None:  # never a checkpoint of a stage whose process group was aborted
            _sweep.job.raise_if_aborted()
        super().save_checkpoint(*args, **kwargs)


# ---------- HydraFSDP: sharding on the CPU too, and its checkpoints


class _HydraFSDP(_HydraStrategy):
    """What HydraFSDP adds: sharding on CPU, once for all of a job's stages, and its checkpoints."""

    _sharded: torch.nn.Module | None = None  # the FSDP wrapper of the last stage's module

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "_state_dict_type", None) not in ("full", "sharded"):
            raise _upstream_changed("FSDPStrategy._state_dict_type", "tell full from sharded checkpoints")

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # A module sharded by an earlier stage (fit, then test) keeps its wrapper: Lightning would wrap
        # its shards again (Lightning issue #19015).
        if not self._holds_sharded(model):
            self._sharded = _sharded(self, model, super()._setup_model, self.kwargs)
        return self._sharded

    def _holds_full_parameters(self) -> bool:
        return not self._holds_sharded(self.lightning_module)

    def _holds_sharded(self, model: torch.nn.Module) -> bool:
        return isinstance(self._sharded, _fsdp().FullyShardedDataParallel) and self._sharded.module is model

    def lightning_module_state_dict(self) -> dict:
        with _full_state_gathered_in_place(self):
            return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        # An nn.Module kept in the hyperparameters would be pickled sharded, which no loader can put back:
        # pickle it holding the full state dict's tensors (full), or the gathered parameters (sharded).
        modules = _modules_in(checkpoint.get("hyper_parameters"))
        if not modules:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if self._state_dict_type == "full":
            with _unsharded_while_pickled(modules, checkpoint["state_dict"], self.lightning_module):
                return super().save_checkpoint(checkpoint, filepath, storage_options)
        # Gathered to the CPU from GPUs, not onto rank 0's GPU: a whole model on one GPU is what FSDP avoids.
        # On the CPU in place, as a full state dict is gathered there (see _full_state_gathered_in_place).
        summon_full_params = _fsdp().FullyShardedDataParallel.summon_full_params
        offload = self.root_device.type != "cpu"
        with summon_full_params(self.model, writeback=False, rank0_only=True, offload_to_cpu=offload):
            return super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, **kwargs: Any) -> dict:
        """Load a checkpoint HydraFSDP or HydraDDP wrote: a full one memory-mapped (Lightning's lazy
        loader cannot rebuild a pickled Parameter), a sharded one also with an optimizer without state."""
        path = Path(self.broadcast(checkpoint_path))
        weights_only = kwargs.get("weights_only")  # Lightning's default, None, is torch.load's default
        fitting = self.lightning_module.trainer.state.fn == "fit"
        strict = getattr(self.lightning_module, "strict_loading", True)
        if path.is_dir():
            metadata = _metadata_file(path)
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

            sharded_state_dict = _fsdp().StateDictType.SHARDED_STATE_DICT
            with _fsdp().FullyShardedDataParallel.state_dict_type(self.model, sharded_state_dict):
                state = {"model": self.model.state_dict()}
                dcp.load(state, checkpoint_id=path)
                self.model.load_state_dict(state["model"], strict=strict)
                for index, optimizer in enumerate(self.optimizers if fitting else []):
                    key = f"optimizer_{index}"
                    saved = load_sharded_optimizer_state_dict(state["model"], key, dcp.FileSystemReader(path))
                    self._load_optimizer(optimizer, {"state": {}, **saved[key]})
            return torch.load(metadata, weights_only=weights_only)
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        with _full_state_dict_in_place(self.model, rank0_only=False):
            states = checkpoint.get("optimizer_states") if fitting else None
            if states is not None and len(states) != len(self.optimizers):
                raise RuntimeError(f"The checkpoint {path} holds the state of {len(states)} optimizer(s), and"
                                   f" the module configures {len(self.optimizers)}: resume with the"
                                   " optimizers it was saved with.")  # fmt: skip
            self.model.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
            for optimizer, state in zip(self.optimizers, states or []):
                self._load_optimizer(optimizer, _keyed_by_name(state, self.model))
        return checkpoint

    def _load_optimizer(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        to_load = _fsdp().FullyShardedDataParallel.optim_state_dict_to_load
        optimizer.load_state_dict(to_load(model=self.model, optim=optimizer, optim_state_dict=state))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        with _full_state_gathered_in_place(self):
            return super().optimizer_state(optimizer)


def _sharded(strategy: Any, model: torch.nn.Module, setup: Callable, kwargs: dict) -> torch.nn.Module:
    """``setup(model)``, Lightning's wrapping of the model in FSDP (the Trainer's or Fabric's), made to work
    on the CPU too, and kept for the job's end to free (``_sweep.wrapped``). Lightning passes FSDP
    device_id=None on the CPU, and torch's FSDP then looks for an accelerator: there the model is wrapped
    here, with the CPU device, and Lightning is handed the wrapper."""
    fsdp = _fsdp().FullyShardedDataParallel
    wrapping = strategy.root_device.type == "cpu" and not any(isinstance(m, fsdp) for m in model.modules())
    if wrapping:
        model = fsdp(
            module=model, cpu_offload=strategy.cpu_offload, mixed_precision=strategy.mixed_precision_config,
            sharding_strategy=strategy.sharding_strategy, device_id=strategy.root_device, **kwargs
        )  # fmt: skip
    # Lightning warns about an auto_wrap_policy given with a model wrapped already, and drops it: the
    # wrapper above applied it, so Lightning is not shown it (and it is put back for the next stage).
    # A model the user wrapped keeps the warning: the policy was not applied.
    auto_wrap_policy = kwargs.pop("auto_wrap_policy", None) if wrapping else None
    try:
        _sweep.wrapped.append(setup(model))
        return _sweep.wrapped[-1]
    finally:
        if auto_wrap_policy is not None:
            kwargs["auto_wrap_policy"] = auto_wrap_policy


def _keyed_by_name(state: dict, model: torch.nn.Module) -> dict:
    """An optimizer state written without FSDP (by DDP) is keyed by position: key it by name, for ``model``
    (HydraFSDP's wrapper, HydraModelParallel's module). torch leaves one without per-parameter entries (SGD
    without momentum) as it is."""
    positions = [key for group in state["param_groups"] for key in group["params"]]
    if not any(isinstance(key, int) for key in positions):
        return state
    fsdp = _fsdp()
    entries = state["state"] or {key: {} for key in positions}
    named = fsdp.FullyShardedDataParallel.rekey_optim_state_dict(
        {**state, "state": entries}, fsdp.OptimStateKeyType.PARAM_NAME, model
    )
    return {**named, "state": named["state"] if state["state"] else {}}


def _metadata_file(checkpoint: Path) -> Path:
    """What Lightning saves of a sharded checkpoint besides its shards: loops, callbacks, hparams."""
    path = checkpoint / "meta.pt"
    if not path.is_file():
        raise _upstream_changed(f"the name of Lightning's {path}", "load what a sharded checkpoint holds")
    return path


def _modules_in(value: Any) -> list:
    if isinstance(value, dict):
        return [module for item in value.values() for module in _modules_in(item)]
    if isinstance(value, (list, tuple)):
        return [module for item in value for module in _modules_in(item)]
    return [value] if isinstance(value, torch.nn.Module) else []


@contextlib.contextmanager
def _unsharded_while_pickled(modules: list, state_dict: dict, root: torch.nn.Module) -> Any:
    """While the checkpoint is pickled, give ``modules`` (in ``root``) what DDP's would hold: each
    FSDP unit as the module it wraps (process groups do not pickle), each parameter as the tensor of rank
    0's full ``state_dict``."""
    with contextlib.ExitStack() as undo:  # each change undone at the end, the last first
        for parent in [inner for module in modules for inner in module.modules()]:
            for key, child in list(parent.named_children()):
                if isinstance(child, _fsdp().FullyShardedDataParallel):
                    undo.callback(setattr, parent, key, child)
                    setattr(parent, key, child.module)
        names = {id(module): _unwrapped_name(name) for name, module in root.named_modules()}
        for module in modules:
            for name, parameter in module.named_parameters() if id(module) in names and state_dict else ():
                key = ".".join(filter(None, (names[id(module)], _unwrapped_name(name))))
                if key not in state_dict:
                    raise _upstream_changed(f"FSDP's name for a wrapped module ({key!r})", "find its weights")
                undo.callback(setattr, parameter, "data", parameter.data)
                parameter.data = state_dict[key]
        yield


def _unwrapped_name(name: str) -> str:
    """A parameter's or module's name as FSDP's state dict keys it: without its wrappers' part."""
    return ".".join(part for part in name.split(".") if part != "_fsdp_wrapped_module")


@contextlib.contextmanager
def _full_state_gathered_in_place(strategy: Any) -> Any:
    """While Lightning's FSDPStrategy (the Trainer's or Fabric's) gathers a full state dict on the CPU: have
    it gather in place. Lightning's ``_get_full_state_dict_context`` gathers with ``offload_to_cpu``, which
    with shards on the CPU frees memory the state dict points to: a segfault that ends the sweep (Lightning
    issue #21804). Lightning has no setting for it, so its context is swapped for ours meanwhile."""
    owner = sys.modules[strategy._lightning.strategies.FSDPStrategy.__module__]
    context = getattr(owner, "_get_full_state_dict_context", None)
    if not callable(context):
        raise _upstream_changed(f"{owner.__name__}._get_full_state_dict_context", "save a full state on CPU")
    if strategy.root_device.type == "cpu":
        owner._get_full_state_dict_context = _full_state_dict_in_place
    try:
        yield
    finally:
        owner._get_full_state_dict_context = context


def _full_state_dict_in_place(module: torch.nn.Module, world_size: int = 1, rank0_only: bool = True) -> Any:
    """FSDP's full-state-dict context without ``offload_to_cpu`` (see above), with the signature of
    Lightning's, which it stands in for (``world_size``: unused there too). Rank 0 alone gathers to save."""
    fsdp, config = _fsdp(), {"offload_to_cpu": False, "rank0_only": rank0_only}
    configs = fsdp.FullStateDictConfig(**config), fsdp.api.FullOptimStateDictConfig(**config)
    return fsdp.FullyShardedDataParallel.state_dict_type(module, fsdp.StateDictType.FULL_STATE_DICT, *configs)


# ---------- HydraModelParallel: FSDP2 and tensor parallelism


class _HydraModelParallel(_HydraStrategy):
    """What HydraModelParallel adds: two mistakes named, a full checkpoint of SGD loadable."""

    def setup_environment(self) -> None:
        sizes = {getattr(self, "_data_parallel_size", 0), getattr(self, "_tensor_parallel_size", 1)}
        super().setup_environment()
        if sizes == {"auto"} and self.num_nodes == 1 and self.world_size > 1:
            log.warning("hydra_fsdp: HydraModelParallel's default mesh on one node is data_parallel=1 x"
                        f" tensor_parallel={self.world_size}: it shards no data (every rank reads the same"
                        f" batches). For FSDP2 alone set data_parallel_size={self.world_size},"
                        " tensor_parallel_size=1.")  # fmt: skip

    @contextlib.contextmanager
    def model_sharded_context(self) -> Any:
        try:
            with super().model_sharded_context():  # around configure_model
                yield
        except AssertionError as error:
            if "can only be applied to a module once" not in str(error):
                raise
            raise RuntimeError("configure_model() sharded a module again: Lightning calls it before every"
                               " stage (fit, then test). Make it idempotent: skip one sharded already"
                               " (`isinstance(module, FSDPModule)`).") from error  # fmt: skip

    def load_checkpoint(self, checkpoint_path: Any, **kwargs: Any) -> dict:
        # A full checkpoint is read once, by Lightning (to the CPU); its optimizers' states are loaded here:
        # one without per-parameter state (SGD) fails in lightning_fabric's _rekey_optimizer_state_if_needed.
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_file() or not self.optimizers:
            return super().load_checkpoint(path, **kwargs)
        optimizers, self.optimizers = self.optimizers, []
        try:
            checkpoint = super().load_checkpoint(path, **kwargs)
        finally:
            self.optimizers = optimizers
        strict = getattr(self.lightning_module, "strict_loading", True)
        for optimizer, state in zip(optimizers, checkpoint["optimizer_states"]):
            if not state["state"]:  # nothing to reshard: torch's own load
                optimizer.load_state_dict(state)
                continue
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            state = _keyed_by_name(state, self.model)  # keyed by position (as DDP saves it): by name
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)
        return checkpoint


# ---------- Lightning Fabric's strategies


class _HydraFabricStrategy(_HydraStrategy):
    """What a Fabric's strategy adds: the ranks compare the Fabric they built; ``launch()`` starts the job's
    ranks as a Trainer's first stage does, and they then run until the job's end (Fabric has no stages)."""

    def __repr__(self) -> str:
        return f"<{__name__}.{type(self).__qualname__}: for a {self._lightning.__name__}.Fabric>"


class _HydraFabricFSDP(_HydraFabricStrategy):
    """A Fabric's HydraFSDP: sharding on the CPU too, and its wrappers freed at the job's end."""

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return _sharded(self, module, super().setup_module, self._fsdp_kwargs)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        with _full_state_gathered_in_place(self):
            super().save_checkpoint(*args, **kwargs)


# ---------- the public classes, on the Lightning namespace in use
# Lightning's strategies are classes of one of two namespaces (pytorch_lightning, lightning.pytorch), and a
# Trainer takes only its own namespace's; so the class a user configures, ``hydra_fsdp.HydraDDP`` (below),
# holds no code: calling it builds ``hydra_fsdp.<namespace>.HydraDDP``, a subclass of ``_HydraStrategy``
# (what every strategy adds, above) and of that namespace's ``DDPStrategy``, made by ``_strategies_for``.
# HydraFSDP adds ``_HydraFSDP``, HydraModelParallel ``_HydraModelParallel``; Fabric's ones
# ``_HydraFabricStrategy``.


@functools.cache
def _strategies_for(namespace: str, fabric: bool = False) -> types.SimpleNamespace:
    """Build the strategies on one Lightning namespace, the Trainer's or (``fabric``) Fabric's: each Trainer
    or Fabric takes only its own."""
    prefix = "fabric" if fabric else namespace
    try:
        lightning = importlib.import_module((_FABRIC_NAMESPACES if fabric else _NAMESPACES)[namespace])
    except ImportError as error:
        raise ImportError(
            f"hydra_fsdp.{prefix} needs the {namespace.replace('_', '-')} package (missing): pip install it."
        ) from error
    strategies = lightning.strategies
    # < 2.4: a concrete stand-in (ParallelStrategy is abstract), refused
    model_parallel = getattr(strategies, "ModelParallelStrategy", strategies.DDPStrategy)

    def build(public: type, *bases: type) -> type:
        qualname = f"{prefix}.{public.__name__}"
        attributes = {"__module__": __name__, "__qualname__": qualname, "__doc__": public.__doc__}
        return type(public.__name__, bases, {**attributes, "_lightning": lightning})

    setup = getattr(strategies.FSDPStrategy, "_setup_model", None)  # its own, which _HydraFSDP's overrides
    if not fabric and (not callable(setup) or setup is getattr(strategies.Strategy, "_setup_model", None)):
        raise _upstream_changed(f"{lightning.__name__}'s FSDPStrategy._setup_model", "wrap the module once")
    return types.SimpleNamespace(
        HydraDDP=build(HydraDDP, _HydraFabricStrategy if fabric else _HydraStrategy, strategies.DDPStrategy),
        HydraFSDP=build(HydraFSDP, _HydraFabricFSDP if fabric else _HydraFSDP, strategies.FSDPStrategy),
        HydraModelParallel=build(
            HydraModelParallel, _HydraFabricStrategy if fabric else _HydraModelParallel, model_parallel
        ),
    )


def _namespace_in_use(namespaces: dict = _NAMESPACES) -> str:
    """The Lightning namespace the program imported, which its Trainer (or Fabric) comes from (Hydra imports
    a Trainer's class before it builds its strategy); where both or neither are imported, the first
    installed."""
    imported = [namespace for namespace, package in namespaces.items() if package in sys.modules]
    if len(imported) == 1:
        return imported[0]
    for namespace, package in namespaces.items():
        if importlib.util.find_spec(package.split(".")[0]) is not None:
            return namespace
    raise ImportError("neither pytorch-lightning nor lightning is installed; pip install pytorch-lightning.")


class _OfTheLightningImported(type):
    """``hydra_fsdp.HydraDDP(...)`` builds ``hydra_fsdp.<namespace>.HydraDDP(...)`` of the Lightning imported,
    and any namespace's one is an instance of it."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return getattr(_strategies_for(_namespace_in_use()), cls.__name__)(*args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        # one of the classes _strategies_for built under this name, on any namespace, or a subclass of one
        return any(
            base.__module__ == __name__ and base.__name__ == cls.__name__ for base in type(instance).__mro__
        )


class HydraDDP(metaclass=_OfTheLightningImported):
    """Lightning's ``DDPStrategy``, every child rank running the Hydra job's own task function. Extra
    arguments: ``rank_timeout`` (seconds the fork server may take to start, a child to reach the process
    group, or to finish after rank 0; 600), ``module_key``, ``datamodule_key`` (for the fallback)."""


class HydraFSDP(metaclass=_OfTheLightningImported):
    """Lightning's ``FSDPStrategy``, started like HydraDDP (the same extra arguments), and able to shard on
    CPU over gloo."""


class HydraModelParallel(metaclass=_OfTheLightningImported):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism: the module shards itself in
    ``configure_model`` over ``self.device_mesh``), started like HydraDDP (the same extra arguments)."""


def __getattr__(name: str) -> Any:
    """``hydra_fsdp.lightning`` and ``hydra_fsdp.pytorch_lightning``, built on first use; and
    ``hydra_fsdp.fabric``: the same three for a Fabric, on ``lightning.fabric`` or ``lightning_fabric``,
    whichever the program imported."""
    if name in _NAMESPACES:
        return _strategies_for(name)
    if name == "fabric":
        return _strategies_for(_namespace_in_use(_FABRIC_NAMESPACES), True)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -------------------- the launcher: every rank a fresh process
# ``hydra/launcher=hydra_fsdp`` (settings: hydra_plugins/hydra_fsdp_launcher). The sweep's process runs the
# sweeper and forks a job agent per job, at most n_jobs at once, as joblib's workers and torchrun's agents
# are: it never runs Hydra's job machinery or a task function, and holds no lock. An agent runs run_job for
# its job (the job's dir, .hydra, chdir, env_set, logging, callbacks) with a task function that claims the
# job's devices, starts its ranks with torchrun's environment, waits for them, ends them and returns rank 0's
# result; it hands its JobReturn back, less the config the sweep has, and exits (docs/launcher.md):
#
#     sweep (sweeper, the fork server's owner) ──fork──> job agent ──asks──> fork server ──fork──> rank 0..N-1
#
# A task function a child cannot import by name (a closure, a notebook's) runs in forks of the agent's own
# copy of the sweep, which has it in memory (``_local_fork_server``), where that copy never touched CUDA.

_RESULT_ENV = "HYDRA_FSDP_RESULT"  # set for rank 0 under the launcher: where it writes its outcome
_RESULT_FILE = "rank_0.result.pickle"  # in the job's dir, until the job's agent has read it
_PLAIN = "Return plain values from the task function (numbers, strings, dicts and lists of them, tensors)."
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Interrupted(BaseException):
    """SIGINT or SIGTERM reached the sweep or a job agent: its jobs' ranks end, with a grace."""


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted(signum)


class HydraFSDPLauncher(Launcher):
    """Run each job's ranks 0..N-1 as forks of the fork server, each as torchrun would start it::

        RANK=<r> LOCAL_RANK=<r> GROUP_RANK=0 NODE_RANK=0 WORLD_SIZE=<N> LOCAL_WORLD_SIZE=<N> \\
        MASTER_ADDR=127.0.0.1 MASTER_PORT=<a free port> TORCHELASTIC_RUN_ID=hydra_fsdp-<job number> \\
        OMP_NUM_THREADS=<its threads> HYDRA_FSDP_RANK_CORES=<its cores> (CUDA_VISIBLE_DEVICES=<the job's>) \\
        HYDRA_FSDP_RESULT=<job dir>/rank_0.result.pickle (rank 0) \\
            python /path/to/hydra_fsdp.py <job dir>/rank_config.pickle  >> <job dir>/rank_<r>.log 2>&1

    (the launch file of ``_write_launch``: the job's task function and config), so that Lightning, Fabric
    and torch find their ranks started (hydra_fsdp's strategies then start none): rank 0 first, ranks
    1..N-1 once it serves the job's store on MASTER_PORT, in Lightning's order. The job's result is rank
    0's: its return value, or its exception; else the error of the rank that failed first."""

    def __init__(self, n_jobs: int = 1, job_timeout: Any = None, shutdown_grace: float = 30.0, **rest: Any):
        # the rest (nproc_per_node, accelerator, ...) are read per job, from the job's config (_job_spec)
        if type(n_jobs) is not int or n_jobs < 1 or not (job_timeout is None or job_timeout > 0):
            raise ValueError(f"hydra.launcher.n_jobs={n_jobs!r}, job_timeout={job_timeout!r}: expected n_jobs"
                             " an int >= 1 and job_timeout seconds > 0, or null for no limit.")  # fmt: skip
        self.n_jobs, self.job_timeout, self.grace = n_jobs, job_timeout, shutdown_grace

    def setup(self, *, hydra_context: Any, task_function: Callable, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list:
        """Run the jobs, ``n_jobs`` agents at once. On SIGINT or SIGTERM start no more, pass it on to every
        running agent once, wait for them (their ranks' grace), then end as the signal does; on a second
        one, or past that bound, kill the agents (the fork server ends their ranks with them)."""
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        numbers = range(initial_job_idx, initial_job_idx + len(job_overrides))
        pending, agents, returns, ended = list(zip(numbers, job_overrides))[::-1], {}, {}, {}
        # Ranks fork from the fork server where a child can import the task function (else: the agent's own)
        lightning, importable = _NAMESPACES[_namespace_in_use()], _pickled(self.task_function, "")[0]
        started_server = functools.partial(_ForkServer, lightning, self.config.hydra.job.env_set)
        server = started_server() if importable else None
        handlers = {signum: signal.signal(signum, _raise_interrupted) for signum in _STOP_SIGNALS}
        stopped, deadline = None, math.inf
        try:
            while agents or pending and stopped is None:
                try:
                    while pending and stopped is None and len(agents) < self.n_jobs:
                        if server is not None and server.proc.poll() is not None:  # it died: a new one
                            server = started_server()
                        agents.update([self._fork_agent(server, *pending.pop())])
                    if time.monotonic() > deadline:
                        _signal_agents(agents, signal.SIGKILL)
                    left = None if stopped is None else max(0.0, deadline - time.monotonic())
                    returns.update(_answers(agents, ended, left))
                except _Interrupted as interrupted:  # the second: at once
                    deadline = time.monotonic() + (self.grace + 2 * _KILL_WAIT if stopped is None else 0)
                    stopped = stopped or interrupted.args[0]
                    _signal_agents(agents, stopped)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            _signal_agents(agents, signal.SIGKILL)  # what an error left: ended with their ranks
            for _ in range(len(agents)):  # each reaped, bounded: one the kernel holds is left behind
                _answers(agents, ended, _KILL_WAIT)
            if server is not None:
                server.close()
        _log_summary([returns[number] for number in numbers if number in returns], ended)
        if stopped is not None:
            raise KeyboardInterrupt if stopped == signal.SIGINT else SystemExit(128 + stopped)
        return [returns[number] for number in numbers]

    def _fork_agent(self, server: _ForkServer | None, number: int, overrides: Any) -> tuple:
        """Start job ``number``'s agent: the read end of its pipe, and the agent."""
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id, config.hydra.job.num = str(number), number
        connection = server and server.connect()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            self._run_agent(config, connection, write_end)
        os.close(write_end)
        if connection is not None:
            connection.conn.close()  # the agent's
        return read_end, types.SimpleNamespace(pid=pid, number=number, config=config, said=[])  # so far

    def _run_agent(self, config: DictConfig, connection: Any, write_end: int) -> None:
        """In a job agent: run the job with Hydra's run_job, hand back its JobReturn (less the config: one
        made at run time may not pickle), and exit."""
        try:
            os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the sweep alone, which passes it on once
            _exit_with(os.getppid())
            task_function = functools.partial(self._run_ranks, connection)
            ret = run_job(task_function, config, "hydra.sweep.dir", "hydra.sweep.subdir", self.hydra_context)
            ret.cfg, outcome = None, {"ret": ret}
        except BaseException as error:  # noqa: BLE001 - the job's, for the sweep to report
            outcome = {"error": error}
        outcome["ended"] = getattr(self, "ended", None)
        try:
            pickled = pickle.dumps(outcome)
        except Exception as error:  # noqa: BLE001 - what the job's callbacks put in it
            pickled = pickle.dumps({"error": RankLaunchError(f"Its outcome cannot be pickled: {error!r}")})
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(pickled)
        os._exit(0)

    def _run_ranks(self, server: _ForkServer | None, task_cfg: DictConfig) -> Any:
        """The task function run_job runs in the agent: start the job's ranks, wait for them, return rank 0's
        result; on SIGINT or SIGTERM, end them with a grace (``_ChildRanks.close``)."""
        hydra_job = dict(_hydra_job(), task_function=self.task_function)
        number, started = hydra_job["config"].hydra.job.num, time.monotonic()
        children = _ChildRanks(Path(HydraConfig.get().runtime.output_dir), threading.Condition())
        try:
            with contextlib.ExitStack() as job:
                job.callback(children.end)
                try:
                    failures = _start_ranks(job, children, hydra_job, server)
                    settled = _wait_until(children.said, children.settled, self.job_timeout)
                except _Interrupted as interrupted:
                    killed = children.close(interrupted.args[0], self.grace)
                    raise _interruption(interrupted.args[0], time.monotonic() - started, killed) from None
                returned = _outcome(children, failures, settled, self.job_timeout)
        except BaseException as error:  # its ranks ended, its devices let go of: say so
            self.ended = (time.monotonic() - started, f"{type(error).__name__}: {error}")
            log.error(f"hydra_fsdp: job #{number} failed after {self.ended[0]:.1f} s: {error}")
            raise
        self.ended = (time.monotonic() - started, f"returned {returned!r}")
        log.info(f"hydra_fsdp: job #{number} completed in {self.ended[0]:.1f} s, returned {returned!r}")
        return returned


def _signal_agents(agents: dict, signum: int) -> None:
    for agent in agents.values():
        with contextlib.suppress(ProcessLookupError):  # not reaped yet: its pid is still its own
            os.kill(agent.pid, signum)


def _answers(agents: dict, ended: dict, timeout: float | None) -> dict:
    """One look at what the agents wrote back, within ``timeout`` s (None: until one writes): the JobReturn
    of each that ended, by job number, and what the summary says of it in ``ended``."""
    returns: dict = {}
    for fd in select.select(list(agents), [], [], timeout)[0] if agents else ():
        if said := os.read(fd, 1 << 20):
            agents[fd].said.append(said)
            continue
        os.close(fd)
        agent = agents.pop(fd)
        code = os.waitstatus_to_exitcode(os.waitpid(agent.pid, 0)[1])
        returns[agent.number] = _job_return(agent, code, ended)
    return returns


def _job_return(agent: Any, code: int, ended: dict) -> JobReturn:
    """The JobReturn an agent handed back, with the job's config; or a failed one saying how it ended."""
    outcome = {}
    with contextlib.suppress(Exception):  # nothing, or part of it: it died
        outcome = pickle.loads(b"".join(agent.said))
    error = outcome.get("error") or ChildRankError(
        f"The agent of job #{agent.number} (pid {agent.pid}) ended ({_exit_status(code)}) before it handed"
        " back the job's result; the job's ranks ended with it. Its output is above."
    )
    ended[agent.number] = outcome.get("ended") or (0.0, f"{error!r}")
    hydra_cfg, overrides = OmegaConf.create({"hydra": agent.config.hydra}), agent.config.hydra.overrides.task
    ret = outcome.get("ret") or JobReturn(
        list(overrides), hydra_cfg=hydra_cfg, status=JobStatus.FAILED, _return_value=error
    )
    ret.cfg = copy.deepcopy(agent.config)
    with read_write(ret.cfg), open_dict(ret.cfg):
        del ret.cfg["hydra"]
    return ret


def _exit_status(code: int) -> str:
    return f"exit code {code}" + (f" (killed by {signal.Signals(-code).name})" if code < 0 else "")


def _interruption(signum: int, seconds: float, killed: list) -> ChildRankError:
    how = signal.Signals(signum).name + (" (Ctrl-C)" if signum == signal.SIGINT else "")
    late = f"; rank(s) {killed} still running after the grace were killed (SIGKILL)" if killed else ""
    return ChildRankError(f"The job was interrupted by {how} after {seconds:.1f} s{late}.")


def _job_spec(settings: DictConfig) -> tuple:
    """The job's ranks and devices, read from its own ``hydra.launcher`` settings: on its accelerator, not
    the node's (a CPU job on a node with GPUs claims cores). Its _LaunchSpec, and the GPUs it may claim."""
    world = settings.nproc_per_node
    if type(world) is not int or world < 1:
        raise RankLaunchError(f"hydra.launcher.nproc_per_node={world!r}: expected the number of ranks of the"
                              " job, an int >= 1 (e.g. hydra.launcher.nproc_per_node=2; by default the job's"
                              " trainer.devices, else 1).")  # fmt: skip
    # torch.cuda.device_count() does not initialise CUDA
    inventory = _gpu_inventory() if settings.accelerator in ("auto", "gpu", "cuda") else {}
    devices = tuple(torch.device("cuda" if inventory else "cpu", rank) for rank in range(world))
    return _LaunchSpec(world, devices, "127.0.0.1", "", settings.rank_timeout, None, None), inventory


def _start_ranks(job: contextlib.ExitStack, children: _ChildRanks, hydra_job: dict, server: Any) -> list:
    """Claim the job's devices (let go of at ``job``'s end), start its ranks and say so. Return the list
    the fork server's thread appends each failed rank to."""
    config, job_dir = hydra_job["config"], children.job_dir
    spec, inventory = _job_spec(config.hydra.launcher)
    placement = _placement(spec, job)
    for leftover in (_RESULT_FILE, _LAUNCH_FILE):  # an earlier run's into this dir is never this one's
        (job_dir / leftover).unlink(missing_ok=True)
        job.callback((job_dir / leftover).unlink, missing_ok=True)
    why_not = None
    try:
        _write_launch(job_dir / _LAUNCH_FILE, hydra_job, spec)
    except RankLaunchError as error:  # a child cannot import the task function (or the config's classes)
        why_not = error
    if why_not is not None:  # forked here, not in the except: a fork would run the job in its context
        cuda = bool(inventory) or config.hydra.launcher.accelerator in ("gpu", "cuda")
        server = _local_fork_server(hydra_job, why_not, cuda)  # (the fork server's connection unused)
    server.listen(children.said)
    env = _torchrun_env(spec.world_size, config.hydra.job.num, placement, inventory)
    env[_RESULT_ENV] = str(job_dir / _RESULT_FILE)  # rank 0's (_hand_back)
    where = [f"cores {','.join(map(str, cores))}" for cores in placement.cores if cores is not None]
    log.info(f"hydra_fsdp: job #{config.hydra.job.num} starts ({' '.join(config.hydra.overrides.task)}):"
             f" {spec.world_size} rank(s) on"
             f" {env.get('CUDA_VISIBLE_DEVICES', ' | '.join(where) or 'every core')}, logs"
             f" {job_dir}")  # fmt: skip
    delay, failures = _launch_delay(), []
    command = [sys.executable, os.path.abspath(__file__), str(job_dir / _LAUNCH_FILE)]
    for rank in range(spec.world_size):
        if rank == 1 and not config.hydra.launcher.start_ranks_together:
            _wait_for_rank_0(children, int(env["MASTER_PORT"]), spec.rank_timeout)
        elif rank and delay:
            time.sleep(delay)
        if children.procs and children.procs[0].poll() is not None:
            break  # rank 0 ended first: its outcome is the job's
        env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        if placement.cores[rank] is not None:  # every rank's, or none's
            env[_RANK_CORES_ENV] = ",".join(map(str, placement.cores[rank]))
        on_failure = functools.partial(failures.append, rank)
        children.add(rank, server.start(command, env, children.log(rank), spec.rank_timeout, on_failure))
    return failures


def _local_fork_server(hydra_job: dict, why_not: Exception, cuda: bool) -> _ForkServer:
    """For a task function that a child cannot import by name (``why_not``): a fork of this agent, which
    has it in memory (the agent is a fork of the sweep), serves the job's forks as the fork server does;
    not for a job on GPUs (``cuda``) where the sweep's process touched CUDA: a fork of it cannot use CUDA.
    (A job on the CPU runs: its ranks never start CUDA.)"""
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if not callable(in_bad_fork):
        raise _upstream_changed("torch.cuda._is_in_bad_fork", "tell whether a fork of the sweep can use CUDA")
    if cuda and in_bad_fork():
        raise RankLaunchError(f"This job's ranks cannot start: {why_not} So they would be forks of the"
                              " sweep's process, which initialised CUDA (as torch.cuda.is_available() does),"
                              " and such a fork cannot use CUDA. Define the task function at the top level"
                              " of an importable file, or start the sweep with"
                              " PYTORCH_NVML_BASED_CUDA_CHECK=1 (then torch.cuda.is_available() leaves CUDA"
                              " alone).")  # fmt: skip
    server = _ForkServer.__new__(_ForkServer)
    server.imports, (server.conn, theirs) = [], socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        global _child_job
        whitelist = getattr(hydra_job["hydra_context"], "execution_whitelist", None)
        _child_job = {"task_function": hydra_job["task_function"], "task_cfg": _job_config(hydra_job),
                      "whitelist": whitelist}  # fmt: skip
        server.conn.close()  # (the agent's pipe to the sweep it holds too ends as it does, with the agent)
        _serve_forks([], theirs.fileno())
    theirs.close()
    # not this process's to reap: it ends as the agent does (its connection closes)
    server.proc = types.SimpleNamespace(pid=pid, kill=functools.partial(os.kill, pid, signal.SIGKILL))
    server.proc.wait = id
    return server


def _wait_for_rank_0(children: _ChildRanks, port: int, timeout: float) -> None:
    """Lightning's order: ranks 1..N-1 start once rank 0 has built what it builds first (data, model,
    loggers: a logger's database made once) and reached the process group, where it serves the job's store
    on ``port``; or once it has exited (its outcome is then the job's)."""
    rank_0 = children.procs[0]
    if not _wait_until(children.said, lambda: _listening(port) or rank_0.poll() is not None, timeout):
        raise ChildRankError(f"Rank 0 did not reach the process group within {timeout:g} s (nothing listens"
                             f" on MASTER_PORT={port}), so the job's other ranks were not started:"
                             f" {children.describe(0)} Raise hydra.launcher.rank_timeout if it builds for"
                             " longer, or set hydra.launcher.start_ranks_together=true if its ranks meet"
                             " some other way.")  # fmt: skip


def _listening(port: int) -> bool:
    """Whether a socket of this host listens on TCP ``port`` (the kernel's tables: no connection made)."""
    listening = re.compile(rf"^ *\d+: [0-9A-F]+:{port:04X} [0-9A-F]+:0000 0A ", re.MULTILINE)  # 0A: LISTEN
    tables = [Path(table) for table in ("/proc/net/tcp", "/proc/net/tcp6")]
    return any(listening.search(table.read_text()) for table in tables if table.exists())


def _torchrun_env(world: int, number: int, placement: _Placement, inventory: dict) -> dict:
    """What every rank of a job has of torchrun's environment, and of the devices its job holds."""
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", GROUP_RANK="0", PYTHONUNBUFFERED="1",
               TORCHELASTIC_RUN_ID=f"hydra_fsdp-{number}")  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", str(placement.threads))  # a user's value stands
    if placement.gpus is not None:  # cuda:<LOCAL_RANK> is then the rank's GPU, for any strategy
        env["CUDA_VISIBLE_DEVICES"] = ",".join(inventory[gpu] for gpu in placement.gpus)
    return env


def _free_port() -> int:
    """A port free now for rank 0's store, which it binds seconds later: one below the kernel's ephemeral
    range, which no outgoing connection takes meanwhile (a port the OS offers for bind(0) is one of that
    range: a pip download's or a browser's connection took it here, EADDRINUSE); other jobs pick theirs
    at random from 10,000."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 10_000), low), 100):
        with socket.socket() as free, contextlib.suppress(OSError):  # taken: the next
            free.bind(("127.0.0.1", port))
            return port
    raise RankLaunchError(f"No port from {low - 10_000} to {low} was free for a job's rank 0: free some.")


def _outcome(children: _ChildRanks, failures: list, settled: bool, job_timeout: Any) -> Any:
    """Rank 0's return value; else its exception, or the error of the rank that failed first (its log)."""
    if not settled:
        error = ChildRankError(f"The job ran past hydra.launcher.job_timeout={job_timeout} s: raise it if the"
                               " job needs longer; where each rank stood is in its log.")  # fmt: skip
        children.end_saying_where_they_stood(error, "Its ranks were still running;")
        raise error
    first = failures[0] if failures else children.first_failed()
    children.end()  # the others, at once, even blocked in a collective
    if first is not None and not failures and (server := children.procs[first].server).lost:
        # no rank failed: every one ended with it (PR_SET_PDEATHSIG)
        raise ChildRankError(f"The fork server (pid {server.proc.pid}) ended while the job ran, and the job's"
                             f" ranks with it: its error, if any, is in the sweep's output."
                             f" {children.describe(first)}")  # fmt: skip
    result = children.job_dir / _RESULT_FILE
    outcome = {}
    if first in (0, None) and result.exists():
        try:
            outcome = pickle.loads(result.read_bytes())
        except Exception as error:  # noqa: BLE001 - a class the sweep's process cannot import, or more
            outcome = {"error": RankLaunchError(f"Rank 0's outcome does not unpickle: {error!r}. {_PLAIN}")}
    if first is None and "value" in outcome:
        return outcome["value"]
    if isinstance(outcome.get("error"), Exception):  # not rank 0's Ctrl-C: the sweep's to stop on
        _add_note(outcome["error"], f"Raised on {children.describe(0)}")
        raise _with_failure(outcome["error"], outcome.get("sent"))
    if first is None:  # its result file gone or unwritable
        raise ChildRankError(f"Rank 0 handed back no return value at {result}: {children.describe(0)}")
    raise ChildRankError(f"Rank {first} failed first: {children.describe(first)}")


def _with_failure(error: BaseException, sent: tuple | None) -> BaseException:
    """Rank 0's exception made again in the job's agent with its traceback and cause (``_hand_back`` sends
    them, by hydra-core >= 1.4's private serializers, where they are), which 1.4's run_job hands on."""
    from hydra.core import utils

    with contextlib.suppress(Exception):
        frames, chain = sent
        error = error.with_traceback(utils._deserialize_traceback(frames))
        if chain:
            relation, chained = utils._deserialize_exception_chain(chain)
            setattr(error, f"__{relation}__", chained)
    return error


def _hand_back(**outcome: Any) -> None:
    """Under the launcher, rank 0's return value (``value``) or exception (``error``), for the job's agent,
    written whole or not at all. What cannot be pickled is handed back as an error saying so."""
    path = os.environ.get(_RESULT_ENV)
    if path is None or os.environ.get("RANK") != "0":
        return
    with contextlib.suppress(Exception):  # a value; or hydra-core 1.3, or these changed: as pickled
        e, utils = outcome["error"], importlib.import_module("hydra.core.utils")  # e: rank 0's exception
        outcome["sent"] = utils._serialize_traceback(e.__traceback__), utils._serialize_exception_chain(e)
    buffer = io.BytesIO()
    try:
        _ByReference(buffer).dump(outcome)  # a tensor on the CPU: on a GPU it would start CUDA in the sweep
        pickled = buffer.getvalue()
    except Exception as error:  # noqa: BLE001 - PicklingError, or what an object's own __reduce__ raises
        what = f"exception {outcome['error']!r}" if "error" in outcome else ""
        what = what or f"return value (a {type(outcome['value']).__qualname__})"
        why = f"Rank 0's {what} cannot be pickled for the sweep: {error!r}. {_PLAIN}"
        pickled = pickle.dumps({"error": RankLaunchError(why)})
    _write_private(Path(path), pickled)


def _log_summary(returns: list, ended: dict) -> None:
    """The sweep's jobs, the failed first: the lines a long sweep's output is searched for."""
    rows = []
    for ret in sorted(returns, key=lambda ret: ret.status is JobStatus.COMPLETED):
        number = ret.hydra_cfg.hydra.job.num
        seconds, result = ended.get(number) or (0.0, "-")
        row = f"  #{number:<4} {ret.status.name:<9} {seconds:6.1f} s  {' '.join(ret.overrides)}  {result}"
        rows.append(row.splitlines()[0][:300])
    failed = sum(ret.status is JobStatus.FAILED for ret in returns)
    log.info(f"hydra_fsdp: {len(returns)} job(s), {failed} failed:\n" + "\n".join(rows))


# -------------------- a child rank


def _run_child_rank(config_path: str) -> None:
    """Run one child rank: the job's task function on the job's config, as rank 0 runs it. A fork of the
    fork server calls it, and so does ``python hydra_fsdp.py <launch file>`` (``__main__``); under the
    launcher, a fork of a job's agent has the job in memory (``_local_fork_server``)."""
    global _child_job
    if _RANK_CORES_ENV in os.environ:  # the rank's share of its job's cores (_placement), before any thread
        os.sched_setaffinity(0, map(int, os.environ[_RANK_CORES_ENV].split(",")))
    _exit_with(os.getppid())
    faulthandler.register(_STACK_DUMP_SIGNAL, all_threads=True)
    if _child_job is None:
        _child_job = _launched_job(config_path)  # what _hydra_job finds here
    _log_as_the_job(int(os.environ.get("RANK", os.environ["LOCAL_RANK"])))
    if _CHILD_ENV in os.environ:  # started by rank 0 (not by the launcher, which starts every rank)
        _child_store().get(_GO_KEY)  # rank 0 runs this job with this world size: run it here too
    try:
        with _execution_policy(_child_job["whitelist"]):
            _hand_back(value=_child_job["task_function"](_child_job["task_cfg"]))
        exit_code = 0
    except BaseException as error:  # noqa: BLE001 - the job's error, as Hydra prints it, to the child's log
        traceback.print_exc()
        _hand_back(error=error)
        exit_code = 1
    # Exit now: at shutdown gloo's threads, of a group an FSDP module still holds, can abort the process.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _launched_job(config_path: str) -> dict:
    """The job a launch file (``_write_launch``) gives a child: its task function, config and whitelist."""
    launch = pickle.loads(Path(config_path).read_bytes())
    sys.path[:] = launch["sys_path"]
    sys.argv[:] = launch["sys_argv"]
    os.chdir(launch["cwd"])
    _import_launching_script(launch["main"])
    setup_globals()  # Hydra's resolvers: ${hydra:...}, ${now:...}
    _set_hydra_config(launch["hydra"])
    try:  # its types, flags and rank 0's cached ${now:...} values
        task_cfg = pickle.loads(launch["config"])
    except (AttributeError, ImportError) as error:
        raise RankLaunchError(f"A child rank cannot load the config: {error}. {_WHERE_CLASSES_GO}") from error
    _check_resolved_as_on_rank_0(task_cfg, launch["resolved"])
    # the job's own, which rank 0 could pickle; else the fallback's
    fallback = functools.partial(_run_config_contract, **launch["contract"])
    task_function = fallback if launch["task"] is None else pickle.loads(launch["task"])
    return {"task_function": task_function, "task_cfg": task_cfg, "whitelist": launch["whitelist"]}


def _log_as_the_job(rank: int) -> None:
    """Log as Hydra's run_job has its job log: every rank to its stdout (its ``rank_<r>.log``), rank 0 to the
    job's ``<task name>.log`` too, beside the launcher's lines, as it would under Hydra's basic launcher."""
    hydra = HydraConfig.get()
    configure_log(hydra.job_logging, hydra.verbose)
    for handler in logging.getLogger().handlers[:] if rank else ():
        if isinstance(handler, logging.FileHandler):
            logging.getLogger().removeHandler(handler)
            handler.close()


def _execution_policy(whitelist: Any) -> Any:
    """Rank 0's execution policy for a child's task function: from hydra-core 1.4 ``run_job`` runs the task
    function under the job's execution whitelist alone (``@hydra.main(execution_whitelist=...)``'s), which
    decides what a config's ``_target_`` may call. Under another policy a child's ``instantiate`` could
    allow or refuse what rank 0's did not: the ranks would build different things, or one would fail."""
    import hydra.utils

    policy = getattr(hydra.utils, "execution_whitelist", None)  # public from hydra-core 1.4
    return contextlib.nullcontext() if policy is None else policy(whitelist, reset=True)


def _check_resolved_as_on_rank_0(task_cfg: DictConfig, on_rank_0: dict) -> None:
    """Fail before the task function runs if this rank resolves the job's config otherwise than rank 0: a
    resolver without ``use_cache`` (a run id), or one registered only under ``if __name__ == "__main__":``."""
    here, theirs = _flat(_resolved_where_possible(task_cfg)), _flat(on_rank_0)
    key = next((key for key in theirs if here.get(key) != theirs[key]), None)
    if key is not None:  # the first value that differs
        written = _flat(OmegaConf.to_container(task_cfg))[key]
        resolvers = re.findall(r"\$\{\s*([\w.]+)\s*:", str(written))
        unregistered = [name for name in resolvers if not OmegaConf.has_resolver(name)]
        why = f"register {' '.join(map(repr, resolvers))} with use_cache=True: all read rank 0's value"
        if unregistered:
            why = (
                f"the resolver {unregistered[0]!r} is registered on rank 0 only: register it at the top level"
                ' of the script or of a module it imports, not in its `if __name__ == "__main__":` block.'
            )
        raise RankLaunchError(f"The job's config value {key}: {written!r} resolves to {here.get(key)!r} on"
                              f" this child rank and to {theirs[key]!r} on rank 0: {why}")  # fmt: skip


def _set_hydra_config(hydra: dict) -> None:
    """Make rank 0's resolved Hydra config this process's ``HydraConfig``, read-only as Hydra's."""
    hydra_cfg = OmegaConf.create({"hydra": hydra}, flags={"readonly": True})
    HydraConfig.instance().cfg = hydra_cfg  # set_config() wants Hydra's schema, which plugins extend
    if not HydraConfig.initialized() or HydraConfig.get() is not hydra_cfg.hydra:
        raise _upstream_changed("HydraConfig.instance().cfg", "give the child rank the job's Hydra config")


def _run_config_contract(task_cfg: DictConfig, module_key: str, datamodule_key: str) -> None:
    """The fallback task function: build the config's trainer, module (datamodule) and run each stage rank 0
    announces, until it announces the end of the job."""
    trainer = instantiate(task_cfg.trainer)
    module = instantiate(task_cfg[module_key])
    datamodule, store = None, _child_store()  # the datamodule made at the first stage that takes one
    for number in itertools.count():
        stage = json.loads(store.get(_STAGE_KEY.format(number)))
        if stage is None:
            return
        if stage["datamodule"] and datamodule is None:
            datamodule = instantiate(task_cfg[datamodule_key])
        data = {"datamodule": datamodule} if stage["datamodule"] else {}
        getattr(trainer, stage["stage"])(module, ckpt_path=stage["ckpt_path"], **data)


def _child_store() -> torch.distributed.TCPStore:
    """A client of rank 0's store, where a child checks in and the fallback reads its stages."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return torch.distributed.TCPStore(address, port, is_master=False, timeout=_CHILD_STORE_TIMEOUT)


def _import_launching_script(main: dict) -> None:
    """Import rank 0's ``__main__`` as multiprocessing's spawn does (its ``if __name__ == "__main__":``
    block does not run), so that ``__main__.X`` resolves."""
    if "module" in main:
        namespace = runpy.run_module(main["module"], run_name="__mp_main__", alter_sys=False)
    elif "path" in main:
        # on sys.path as `python script.py` has it (a submitit worker's does not)
        if (script_dir := os.path.dirname(main["path"])) not in sys.path:
            sys.path.insert(0, script_dir)
        namespace = runpy.run_path(main["path"], run_name="__mp_main__")
    else:
        return
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


if __name__ == "__main__":
    # Run as a script: the fork server (rank 0 starts it: _ForkServer), or a child rank started by hand
    # from a job's launch file (the command _rank_launch shows). Either runs in the module rank 0 imported,
    # found on rank 0's sys.path, not in this second copy named __main__, whose state no strategy sees.
    if len(sys.argv) == 2:  # python hydra_fsdp.py <launch file>
        _launch = pickle.loads(Path(sys.argv[1]).read_bytes())
        sys.path[:] = _launch["sys_path"]
        importlib.import_module(_launch["module"])._run_child_rank(sys.argv[1])
    if _SERVER_ENV not in os.environ:
        sys.exit(f"usage: python {__file__} <job dir>/{_LAUNCH_FILE}, in the environment _rank_launch shows")
    _server = json.loads(os.environ.pop(_SERVER_ENV))
    sys.path[:] = _server["sys_path"]
    importlib.import_module(_server["module"])._serve_forks(_server["imports"], _server["fd"])
