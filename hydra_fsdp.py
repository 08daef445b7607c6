"""Lightning's DDP and FSDP strategies that work under Hydra, ``--multirun`` sweeps included.

Why
---
Lightning starts ranks 1..N-1 by re-running ``sys.argv``. Inside a Hydra sweep that is the
*sweep* command, so every child rank re-runs the whole sweep (or the wrong job). ``HydraDDP``
and ``HydraFSDP`` instead start every child rank of a job from **that job's own saved config**,
``<job output dir>/<hydra.output_subdir>/config.yaml``, so every rank of every job trains what
rank 0 trains.

Use
---
With hydra-zen::

    from hydra_zen import builds, make_config
    import pytorch_lightning as pl
    from hydra_fsdp import HydraDDP, HydraFSDP

    Trainer = builds(pl.Trainer, accelerator="gpu", devices=2, strategy=builds(HydraFSDP))
    Config = make_config(trainer=Trainer, module=builds(MyModule), datamodule=builds(MyData))

    def task(trainer, module, datamodule):          # run with zen(task)
        trainer.fit(module, datamodule=datamodule)

or in plain YAML ``strategy: {_target_: hydra_fsdp.HydraFSDP}``. The job's config must hold
``trainer`` and ``module`` (``datamodule`` is optional; ``module_key``/``datamodule_key`` name
other keys); child ranks instantiate them and call the stage rank 0 called (fit, validate, test,
predict) with the ``ckpt_path`` rank 0 got.

``hydra_fsdp.HydraDDP``/``HydraFSDP`` subclass ``pytorch_lightning``'s strategies (or
``lightning.pytorch``'s when it is the only one installed); ``hydra_fsdp.lightning.HydraDDP``/
``HydraFSDP`` subclass ``lightning.pytorch``'s. Use the one of your Trainer's namespace.

Arguments beyond Lightning's: ``rank_timeout`` (s, default 600), ``module_key``,
``datamodule_key``, ``warm_ranks`` (keep child ranks for the sweep's next job; default off).
``MUSHIN_DDP_LAUNCH_DELAY`` (seconds, default 1, ``0`` disables) is waited between two child
spawns. Each child rank writes its output to ``<job dir>/rank_<N>.log``.

How
---
For every stage, rank 0 writes ``<job dir>/<hydra.output_subdir>/rank_plan.yaml`` (the job's
config resolved as rank 0 resolves it, Hydra's runtime config, the stage, the checkpoint, the
working directory and ``sys.path``) and starts each child rank as::

    LOCAL_RANK=1 NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=<port> \\
        python /path/to/hydra_fsdp.py <job dir>/.hydra/rank_plan.yaml

Rank 0 holds the rendezvous port for the whole stage, so concurrent sweeps never collide, and
waits for every child to check in before it joins the process group: a child that dies while
starting fails its job at once instead of hanging the rendezvous. A failed rank fails its job,
never the sweep: the other ranks are ended, the error names the rank, its exit code and its log.

Under torchrun or SLURM the engine starts every rank: the strategies spawn nothing, check the
world size before the rendezvous, and make the ranks compare the job they each resolved.
"""

import atexit
import faulthandler
import functools
import gc
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import time
import types
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["HydraDDP", "HydraFSDP", "RankLaunchError", "ChildRankError"]  # noqa: F822 - built on first use

# The Lightning namespaces, by the name a user reaches them under: ``hydra_fsdp.HydraDDP`` is
# built on the first one installed, ``hydra_fsdp.lightning.HydraDDP`` on ``lightning.pytorch``.
_NAMESPACES = {"pytorch_lightning": "pytorch_lightning", "lightning": "lightning.pytorch"}
_PIP_NAMES = {"pytorch_lightning": "pytorch-lightning", "lightning": "lightning"}

LAUNCH_DELAY_ENV = "MUSHIN_DDP_LAUNCH_DELAY"
DEFAULT_LAUNCH_DELAY = 1.0
DEFAULT_RANK_TIMEOUT = 600.0
_PLAN_FILE = "rank_plan.yaml"
_CHECK_IN_KEY = "hydra_fsdp/ready/{}"
_DONE_KEY = "hydra_fsdp/done/{}"
# What a launch may change in rank 0's environment (it sets MASTER_PORT; Lightning sets
# MASTER_ADDR/MASTER_PORT and its teardown deletes WORLD_SIZE): put back as it was afterwards,
# so that the next job of the sweep neither reuses this job's port nor mistakes itself for a
# child, and nothing a scheduler set is lost.
_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
# Set in the environment of the child ranks hydra_fsdp starts: the plan they run.
_PLAN_ENV = "HYDRA_FSDP_PLAN"
_DIFFERENCES_SHOWN = 5
# How often rank 0 looks at its children's check-ins and exits: each look is cheap, and each
# wait for it is on the path of every job.
_POLL_INTERVAL = 0.01
_LOG_TAIL_LINES = 20
# After rank 0 saw a collective fail, how long a child that caused it may take to exit.
_PEER_EXIT_GRACE = 2.0
# A child dumps its stack to its log on this signal (faulthandler), before it is ended.
_STACK_DUMP_SIGNAL = signal.SIGUSR1
_STACK_DUMP_WAIT = 0.5


class RankLaunchError(RuntimeError):
    """The job's ranks cannot all run the same job: raised before it trains, nothing left running."""


class ChildRankError(RuntimeError):
    """A child rank failed, hung or was ended; its job fails, the sweep goes on."""


# --------------------------------------------------------------------------- what rank 0 reads


def _launch_delay() -> float:
    raw = os.environ.get(LAUNCH_DELAY_ENV)
    if raw is None:
        return DEFAULT_LAUNCH_DELAY
    try:
        delay = float(raw)
    except ValueError:
        delay = math.nan
    if not math.isfinite(delay) or delay < 0:
        raise RankLaunchError(
            f"{LAUNCH_DELAY_ENV}={raw!r} is not a number of seconds: expected a finite number >= 0"
            f" (e.g. {LAUNCH_DELAY_ENV}=1, or 0 to start child ranks without a pause)."
        )
    return delay


def _saved_config_path() -> Path:
    if not HydraConfig.initialized():
        raise RankLaunchError(
            "HydraDDP/HydraFSDP start child ranks from the running Hydra job's saved config, but no"
            " Hydra job is running here. Call trainer.fit/validate/test/predict inside a Hydra task"
            " function (@hydra.main, hydra_zen.zen or hydra_zen.launch), or use Lightning's own"
            " strategy='ddp'/'fsdp' outside Hydra."
        )
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.output_subdir is None:
        raise RankLaunchError(
            "hydra.output_subdir is null, so Hydra saved no config.yaml for this job and child ranks"
            " have nothing to start from. Remove the hydra.output_subdir=null override (its default"
            " is .hydra)."
        )
    return Path(hydra_cfg.runtime.output_dir, hydra_cfg.output_subdir, "config.yaml")


def _load_saved_config(path: Path, required: tuple[str, ...]) -> DictConfig:
    if not path.is_file():
        raise RankLaunchError(
            f"The job's saved config {path} does not exist, so child ranks have nothing to start"
            " from. Hydra writes it at job start unless hydra.output_subdir is null or the file was"
            " moved; keep hydra.output_subdir set and the job directory in place."
        )
    config = OmegaConf.load(path)
    missing = [key for key in required if key not in config]
    if missing:
        raise RankLaunchError(
            f"The job's saved config {path} has no {', '.join(repr(k) for k in missing)} key"
            f" (it has: {', '.join(map(str, config.keys())) or 'nothing'}). Child ranks instantiate"
            f" the trainer, module and datamodule from it: add the key(s) to your top-level config,"
            " or tell the strategy where they are, e.g. HydraDDP(module_key='model')."
        )
    return config


def _live_job_config() -> Optional[DictConfig]:
    """Return the config object Hydra handed to the running task function, if any.

    Hydra keeps no global handle on it, yet it carries rank 0's resolver cache: the
    ``${now:...}`` values rank 0 has seen, which a fresh load of config.yaml would resolve to
    the present instead. Hydra's ``run_job`` holds it as ``task_cfg``.
    """
    from hydra.core.utils import run_job

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is run_job.__code__:
            return frame.f_locals.get("task_cfg")
        frame = frame.f_back
    return None


def _resolved_as_rank_zero_sees_it(config: DictConfig) -> dict:
    live = _live_job_config()
    if live is not None:
        _resolved_where_possible(live)  # caches every ${now:} rank 0 will read
        OmegaConf.copy_cache(from_config=live, to_config=config)
    else:
        OmegaConf.copy_cache(from_config=HydraConfig.get()._get_root(), to_config=config)
    return _resolved_where_possible(config)


def _resolved_where_possible(config: Any) -> Any:
    """Resolve every value of ``config`` as rank 0 does, for a child to read back literally.

    A value rank 0 cannot resolve either (``???``, or ``${hydra:job.num}`` outside a sweep) is
    kept as written, so that it fails on a child where it would fail on rank 0.
    """
    if not OmegaConf.is_config(config):
        return _escaped(config.name if isinstance(config, Enum) else config)
    is_dict = isinstance(config, DictConfig)
    resolved: Any = {} if is_dict else [None] * len(config)
    for key in config.keys() if is_dict else range(len(config)):
        try:
            resolved[key] = _resolved_where_possible(config[key])
        except OmegaConfBaseException:
            resolved[key] = config._get_node(key)._value()
    return resolved


def _escaped(value: Any) -> Any:
    """Escape ``${`` in resolved strings so that OmegaConf reads them back literally."""
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, (list, tuple)):
        return [_escaped(item) for item in value]
    if isinstance(value, dict):
        return {key: _escaped(item) for key, item in value.items()}
    return value


def _launching_script() -> dict:
    """Say how a child finds the classes of rank 0's ``__main__`` (``_target_: __main__.X``)."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None and not spec.name.endswith("__main__"):
        return {"module": spec.name}
    path = getattr(__main__, "__file__", None)
    if spec is None and path is not None:
        return {"path": os.path.abspath(path)}
    return {}  # an interactive session or a package's __main__: nothing safe to re-import


# --------------------------------------------------------------------------- the plan


def _write_rank_plan(lightning: types.ModuleType, stage_call: dict, keys: dict) -> Path:
    """Write what every child rank of this stage runs next to the job's config; return its path.

    It holds the job's config resolved exactly as rank 0 resolves it (``${hydra:job.num}``,
    ``${now:...}``), Hydra's runtime config, the stage and checkpoint, and what the child needs
    to stand where rank 0 stands: working directory, ``sys.path``, ``sys.argv``, ``__main__``.
    """
    required = (keys["module_key"],) + ((keys["datamodule_key"],) if stage_call["datamodule"] else ())
    saved_config = _saved_config_path()
    config = _load_saved_config(saved_config, ("trainer",) + required)
    process = {
        "stage": stage_call["stage"],
        "ckpt_path": stage_call["ckpt_path"],
        "datamodule": stage_call["datamodule"],
        "lightning": lightning.__name__,
        "module_key": keys["module_key"],
        "datamodule_key": keys["datamodule_key"],
        "cwd": os.getcwd(),
        "sys_path": sys.path,
        "sys_argv": sys.argv,
        "main": _launching_script(),
    }
    plan = dict(
        _escaped(process),
        hydra=_resolved_where_possible(HydraConfig.get()),
        config=_resolved_as_rank_zero_sees_it(config),
    )
    path = saved_config.with_name(_PLAN_FILE)
    OmegaConf.save(OmegaConf.create(plan), path)
    return path


def _stage_call(function: Callable, args: tuple, kwargs: dict, trainer: Any) -> dict:
    """Read from rank 0's call what its children must repeat: stage, checkpoint, datamodule."""
    call = inspect.signature(function).bind(*args, **kwargs).arguments
    passed = [
        name for name in ("train_dataloaders", "val_dataloaders", "dataloaders") if call.get(name) is not None
    ]
    # Lightning also takes a datamodule in the dataloaders' place
    datamodules = [
        name for name in passed if isinstance(call[name], trainer.strategy._lightning.LightningDataModule)
    ]
    dataloaders = [name for name in passed if name not in datamodules]
    if dataloaders:
        raise RankLaunchError(
            f"trainer.{trainer.state.fn.value}() got {' and '.join(dataloaders)} directly, which child"
            " ranks cannot rebuild: they only instantiate the job's config. Put the data in a"
            " LightningDataModule under the config's datamodule key and pass it as datamodule=..., or"
            " define the *_dataloader hooks on your LightningModule."
        )
    model = call["model"] if call.get("model") is not None else trainer.lightning_module
    ckpt_path = trainer._checkpoint_connector._select_ckpt_path(
        trainer.state.fn,
        call.get("ckpt_path"),
        model_provided=call.get("model") is not None,
        model_connected=trainer.lightning_module is not None,
    )
    if ckpt_path is not None and "://" not in str(ckpt_path):
        ckpt_path = os.path.abspath(ckpt_path)
    return {
        "stage": trainer.state.fn.value,
        "ckpt_path": None if ckpt_path is None else str(ckpt_path),
        "datamodule": call.get("datamodule") is not None or bool(datamodules),
        "model": model,
    }


# --------------------------------------------------------------------------- child processes


class _ChildRanks:
    """Ranks 1..N-1 of one stage of one job: started, awaited, checked, and ended.

    Rank 0 binds the rendezvous port before it spawns anyone (a TCPStore that torch's own
    ``init_process_group`` reuses), so two sweeps on one machine cannot pick the same port, and
    children check in through it before anyone blocks in the rendezvous.
    """

    def __init__(
        self, plan_path: Path, job_dir: Path, num_processes: int, address: str, timeout: float, warm: bool
    ) -> None:
        self.plan_path = plan_path
        self.job_dir = job_dir
        self.num_processes = num_processes
        self.address = address
        self.timeout = timeout
        self.warm = warm
        self.procs: dict[int, subprocess.Popen] = {}
        # Port 0: the OS picks a port nobody holds, and we hold it until the stage ends. Never
        # an earlier stage's port: its store may outlive it (an FSDP module keeps its process
        # group), and its stale keys would send this stage's ranks to dead peers.
        self._store = torch.distributed.TCPStore(
            address, 0, is_master=True, multi_tenant=True, wait_for_workers=False
        )
        self.port = self._store.port

    def log_path(self, rank: int) -> Path:
        return self.job_dir / f"rank_{rank}.log"

    def child_env(self, rank: int) -> dict:
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=self.address,
            MASTER_PORT=str(self.port),
            NODE_RANK="0",
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.num_processes),
            PYTHONUNBUFFERED="1",  # a killed child's log must still hold its last words
        )
        env[_PLAN_ENV] = str(self.plan_path)
        return env

    def command(self) -> list[str]:
        return [sys.executable, os.path.abspath(__file__), str(self.plan_path)]

    def start(self, delay: float) -> None:
        """Hand this stage to warm children of an earlier job, or spawn new ones."""
        warm_children = _WARM_CHILDREN.pop(self.num_processes, None) if self.warm else None
        if warm_children is not None and any(proc.poll() is not None for proc in warm_children.values()):
            _end(warm_children)  # one died while it waited (OOM killer, an operator): start afresh
            warm_children = None
        if warm_children is not None:
            self.procs = warm_children
            for rank, proc in self.procs.items():
                assignment = {
                    "plan": str(self.plan_path),
                    "env": self.child_env(rank),
                    "log": str(self.log_path(rank)),
                }
                _send_line(proc, assignment)
            return
        for rank in range(1, self.num_processes):
            if rank > 1 and delay:
                time.sleep(delay)
            with open(self.log_path(rank), "ab") as log:
                self.procs[rank] = subprocess.Popen(
                    self.command(),
                    env=self.child_env(rank),
                    cwd=os.getcwd(),
                    # a warm child reads the stages of later jobs here; a cold one finds no more
                    stdin=subprocess.PIPE if self.warm else subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

    def wait_until_checked_in(self) -> None:
        keys = [_CHECK_IN_KEY.format(rank) for rank in self.procs]
        deadline = time.monotonic() + self.timeout
        while not self._store.check(keys):
            self.raise_if_any_failed()
            if time.monotonic() > deadline:
                late = [rank for rank in self.procs if not self._store.check([_CHECK_IN_KEY.format(rank)])]
                self.end()
                raise ChildRankError(
                    f"Child rank(s) {late} did not reach the process group within {self.timeout:g} s"
                    f" and were ended. {self._describe(late[0])} Raise rank_timeout on the strategy if"
                    " they only start slowly."
                )
            time.sleep(_POLL_INTERVAL)

    def raise_if_any_failed(self) -> None:
        for rank, proc in self.procs.items():
            if proc.poll() not in (None, 0):
                self.end()
                raise ChildRankError(f"Child rank {rank} failed: {self._describe(rank)}")

    def wait_until_done(self) -> None:
        """Wait until every child finished this stage: it said so (warm), or it exited with 0."""
        keys = {rank: _DONE_KEY.format(rank) for rank in self.procs}
        deadline = time.monotonic() + self.timeout
        while not all(
            self._store.check([keys[rank]]) or proc.poll() == 0 for rank, proc in self.procs.items()
        ):
            self.raise_if_any_failed()
            if time.monotonic() > deadline:
                late = [rank for rank, proc in self.procs.items() if proc.poll() is None]
                self.end()
                raise ChildRankError(
                    f"Child rank(s) {late} were still running {self.timeout:g} s after rank 0 finished"
                    f" the stage and were ended. {self._describe(late[0])}"
                )
            time.sleep(_POLL_INTERVAL)

    def first_failure(self, grace: float) -> Optional[int]:
        """Return the rank that failed on its own, giving children ``grace`` s to exit."""
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        failed = [rank for rank, proc in self.procs.items() if proc.poll() not in (None, 0)]
        return failed[0] if failed else None

    def dump_stacks(self) -> list[int]:
        """Have every running child write its Python stack to its log; return their ranks."""
        running = [rank for rank, proc in self.procs.items() if proc.poll() is None]
        for rank in running:
            self.procs[rank].send_signal(_STACK_DUMP_SIGNAL)
        if running:
            time.sleep(_STACK_DUMP_WAIT)
        return running

    def end(self) -> None:
        _end(self.procs)

    def close(self, succeeded: bool) -> None:
        """Keep warm children for the next job if every rank finished; end the rest."""
        if (
            self.warm
            and succeeded
            and self.procs
            and all(proc.poll() is None for proc in self.procs.values())
        ):
            _keep_warm(self.num_processes, self.procs)
        else:
            self.end()
        del self._store

    def _describe(self, rank: int) -> str:
        proc = self.procs[rank]
        code = proc.poll()
        status = "still running" if code is None else f"exit code {code}"
        if code is not None and code < 0:
            status += f" (killed by {signal.Signals(-code).name})"
        log = self.log_path(rank)
        excerpt = "\n".join("    " + line for line in _log_excerpt(log))
        return f"rank {rank} (pid {proc.pid}, {status}); its log is {log}" + (
            f", ending with:\n{excerpt}" if excerpt else "."
        )


# Warm child ranks waiting for the next job of this sweep, by world size. A child joins only
# after a stage that succeeded on every rank; any failure ends the children of that stage.
_WARM_CHILDREN: dict[int, dict[int, subprocess.Popen]] = {}


def _end(procs: dict[int, subprocess.Popen]) -> None:
    """SIGKILL every child still running and reap it: a rank stuck in a collective ignores less."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    for proc in procs.values():
        proc.wait()


def _keep_warm(world_size: int, procs: dict[int, subprocess.Popen]) -> None:
    _end_warm_children()  # one set at a time: a sweep of another world size would strand them
    _WARM_CHILDREN[world_size] = procs
    atexit.unregister(_end_warm_children)  # registered once, however many jobs kept children
    atexit.register(_end_warm_children)


def _end_warm_children() -> None:
    """Close the warm children's input, so that they exit; end any that does not, promptly."""
    for procs in _WARM_CHILDREN.values():
        for proc in procs.values():
            proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(timeout=_PEER_EXIT_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    _WARM_CHILDREN.clear()


def _send_line(proc: subprocess.Popen, message: dict) -> None:
    proc.stdin.write(json.dumps(message).encode() + b"\n")
    proc.stdin.flush()


def _log_excerpt(log: Path) -> list[str]:
    """The end of a child's log or, if it was dumped before being ended, where its main thread stood."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    dumps = [i for i, line in enumerate(lines) if line.endswith("(most recent call first):")]
    for start, end in reversed(list(zip(dumps, dumps[1:] + [len(lines)]))):
        if any("_run_child_rank" in line for line in lines[start:end]):
            return lines[start : start + _LOG_TAIL_LINES]
    return lines[-_LOG_TAIL_LINES:]


class _HydraRankLauncher:
    """Start a job's child ranks from the job's saved config, never from ``sys.argv``.

    Unlike Lightning's ``_SubprocessScriptLauncher`` it can launch again for a second stage,
    ends its children when rank 0 fails, and reports a failed child as its job's error instead
    of killing the whole process (which, under ``--multirun``, is the sweep).
    """

    def __init__(self, strategy: "_HydraStrategy") -> None:
        self.strategy = strategy
        self.children: Optional[_ChildRanks] = None
        self.signal_received: Optional[int] = None

    @property
    def is_interactive_compatible(self) -> bool:
        return False

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = self.strategy
        env = strategy.cluster_environment
        started_by_engine = env.creates_processes_externally
        if started_by_engine:
            _check_launched_world_size(strategy.num_nodes, strategy.num_processes)
        env.validate_settings(num_devices=strategy.num_processes, num_nodes=strategy.num_nodes)
        if started_by_engine:
            return function(*args, **kwargs)
        if strategy.num_nodes > 1:
            raise RankLaunchError(
                f"num_nodes={strategy.num_nodes}, but HydraDDP/HydraFSDP start child ranks on one node"
                " only. Across nodes, let torchrun or SLURM start every rank."
            )
        delay = _launch_delay()
        stage_call = _stage_call(function, args, kwargs, trainer)
        strategy._check_stage(stage_call)
        plan_path = _write_rank_plan(strategy._lightning, stage_call, strategy._config_keys)
        saved_env = {key: os.environ.get(key) for key in _RENDEZVOUS_ENV}
        self.signal_received = None
        job_dir = Path(HydraConfig.get().runtime.output_dir)
        self.children = _ChildRanks(
            plan_path,
            job_dir,
            strategy.num_processes,
            env.main_address,
            strategy.rank_timeout,
            strategy.warm_ranks,
        )
        os.environ["MASTER_PORT"] = str(self.children.port)
        if isinstance(env, _lightning_environment_class(strategy._lightning)):
            env._main_port = -1  # it caches the first port it read; this stage's is new
        try:
            with _sigterm_raises_system_exit():
                self.children.start(delay)
                self.children.wait_until_checked_in()
                result = function(*args, **kwargs)
                self.children.wait_until_done()
                succeeded = True
                return result
        except BaseException as error:
            succeeded = False
            job_error = self._job_error(error)
            if job_error is error:
                raise
            raise job_error from error
        finally:
            self.children.close(succeeded)
            self.children = None
            _restore_env(saved_env)

    def kill(self, signum: int) -> None:
        """Called by Lightning's SIGTERM handler: the job, and with it the sweep, is to stop."""
        self.signal_received = signum
        if self.children is not None:
            self.children.end()

    def _job_error(self, error: BaseException) -> BaseException:
        """The error the job fails with. The children are ended after it, by ``close``."""
        children = self.children
        if self.signal_received is not None:
            return SystemExit(128 + self.signal_received)
        if isinstance(error, (ChildRankError, KeyboardInterrupt, SystemExit)):
            return error
        failed = children.first_failure(grace=_PEER_EXIT_GRACE)
        if failed is not None:
            return ChildRankError(f"Child rank {failed} failed: {children._describe(failed)}")
        # Rank 0's own error, or a collective that timed out on a child that hangs: rank 0's
        # traceback stays the story, and each child's log shows where it stood when ended.
        running = children.dump_stacks()
        children.end()
        _add_note(
            error,
            "Rank 0 failed while these child ranks were still running; they were ended:\n"
            + "\n".join(children._describe(rank) for rank in running),
        )
        return error


def _lightning_environment_class(lightning: types.ModuleType) -> type:
    return importlib.import_module(f"{lightning.__name__}.plugins.environments").LightningEnvironment


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+: printed under the traceback
        error.add_note(note)
    else:
        print(note, file=sys.stderr)


def _check_launched_world_size(num_nodes: int, devices: int) -> None:
    """Fail before the rendezvous, which would otherwise wait for ranks that never come."""
    launched = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS")
    if launched is not None and int(launched) != num_nodes * devices:
        raise RankLaunchError(
            f"The external launcher started {launched} processes (world size), but the Trainer expects"
            f" num_nodes x devices = {num_nodes} x {devices} = {num_nodes * devices}. Start one process per"
            " device on every node (torchrun --nnodes=<num_nodes> --nproc-per-node=<devices>, or SLURM"
            " --nodes=<num_nodes> --ntasks-per-node=<devices>), or set the Trainer's num_nodes and devices"
            " to match."
        )


class _sigterm_raises_system_exit:
    """While rank 0 waits on its children, SIGTERM ends the job cleanly instead of orphaning them."""

    def __enter__(self) -> None:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, _raise_system_exit)

    def __exit__(self, *exc_info: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# --------------------------------------------------------------------------- the strategies


class _HydraStrategy:
    """What HydraDDP and HydraFSDP share: the launcher, the config contract, a clean teardown.

    Mixed in before Lightning's ``DDPStrategy`` or ``FSDPStrategy`` of one Lightning namespace;
    ``_lightning`` is that namespace's package (``pytorch_lightning`` or ``lightning.pytorch``).
    """

    _lightning: types.ModuleType

    def __init__(
        self,
        *args: Any,
        rank_timeout: float = DEFAULT_RANK_TIMEOUT,
        module_key: str = "module",
        datamodule_key: str = "datamodule",
        warm_ranks: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.rank_timeout = rank_timeout
        self.warm_ranks = warm_ranks
        self._config_keys = {"module_key": module_key, "datamodule_key": datamodule_key}

    def _configure_launcher(self) -> None:
        self._launcher = _HydraRankLauncher(self)

    def _check_stage(self, stage_call: dict) -> None:
        """Refuse, before any child starts, a stage whose ranks would not hold the same model."""

    def setup_environment(self) -> None:
        super().setup_environment()
        if self._ranks_started_by_engine():
            _check_ranks_agree(self.global_rank, self.world_size)

    def _ranks_started_by_engine(self) -> bool:
        """Whether torchrun, SLURM or the like started every rank, each running its own Hydra job."""
        return self.cluster_environment.creates_processes_externally and _PLAN_ENV not in os.environ

    def teardown(self) -> None:
        super().teardown()
        # Lightning leaves the process group up. Ours goes: the next job starts its own ranks on
        # a new port. An engine's stays: the next job reuses its ranks and its store, where a new
        # group would find the old group's keys.
        if not self._ranks_started_by_engine() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class _HydraDDP(_HydraStrategy):
    """Lightning's ``DDPStrategy``, with every child rank started from the Hydra job's saved config.

    Extra arguments: ``rank_timeout`` (seconds a child may take to reach the process group, and
    to finish after rank 0 finished; default 600), ``module_key`` and ``datamodule_key`` (where
    the job's config holds them; default ``module`` and ``datamodule``), ``warm_ranks`` (keep
    child ranks alive for the next job of the sweep; default False). The rest is DDPStrategy's.
    """


class _HydraFSDP(_HydraStrategy):
    """Lightning's ``FSDPStrategy``, started like HydraDDP, and able to shard on CPU over gloo.

    Extra arguments as HydraDDP's; the rest is FSDPStrategy's.
    """

    def _check_stage(self, stage_call: dict) -> None:
        model = stage_call["model"]
        if model is not None and model._trainer is not None:
            raise RankLaunchError(
                f"trainer.{stage_call['stage']}() got a LightningModule that already ran a stage in this"
                " process. Under HydraFSDP its weights are sharded across child ranks that have since"
                " exited, and fresh child ranks could not evaluate the same model. Pass a fresh module"
                " and the checkpoint to use, e.g. trainer.test(instantiate(cfg.module), ckpt_path='best')"
                " (or ckpt_path='last' or a path)."
            )

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.root_device.type != "cpu" or any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()
        ):
            return super()._setup_model(model)
        # Lightning passes device_id=root_device.index, None on CPU, and torch's FSDP then looks for
        # an accelerator; so wrap here with the CPU device and let Lightning finish the setup.
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self.kwargs,
        )
        # Lightning warns about, and drops, an auto_wrap_policy given with a wrapped model; ours applied it.
        auto_wrap_policy = self.kwargs.pop("auto_wrap_policy", None)
        try:
            return super()._setup_model(wrapped)
        finally:
            if auto_wrap_policy is not None:
                self.kwargs["auto_wrap_policy"] = auto_wrap_policy

    def lightning_module_state_dict(self) -> dict:
        if not self._full_state_dict_on_cpu():
            return super().lightning_module_state_dict()
        with _full_state_dict_in_place(self.model):
            return self.model.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        if not self._full_state_dict_on_cpu():
            return super().optimizer_state(optimizer)
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
        with _full_state_dict_in_place(self.model):
            state = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
        if self.global_rank == 0:
            state = FullyShardedDataParallel.rekey_optim_state_dict(
                state, OptimStateKeyType.PARAM_ID, self.model
            )
        return state

    def _full_state_dict_on_cpu(self) -> bool:
        return self._state_dict_type == "full" and self.root_device.type == "cpu"


def _full_state_dict_in_place(module: torch.nn.Module) -> Any:
    """FSDP's full-state-dict context without ``offload_to_cpu``.

    Lightning always asks FSDP to offload the gathered state to the CPU; with shards already on
    the CPU that frees memory the state dict still points to, and the process segfaults
    (Lightning issue #21804). Rank 0 alone gathers, as Lightning does.
    """
    from torch.distributed.fsdp import (
        FullStateDictConfig,
        FullyShardedDataParallel,
        StateDictType,
    )
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    return FullyShardedDataParallel.state_dict_type(
        module=module,
        state_dict_type=StateDictType.FULL_STATE_DICT,
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
    )


def _check_ranks_agree(rank: int, world_size: int) -> None:
    """Fail the job if its ranks, each resolving its own Hydra job, disagree on what it is.

    Under torchrun or SLURM every process composes the sweep itself; anything it computes alone
    (a ``${now:...}`` a second apart, a random seed) would split one job's ranks across output
    dirs or configs. They compare what they resolved, once the process group is up.
    """
    mine = _resolved_job()
    everyone: list = [None] * world_size
    torch.distributed.all_gather_object(everyone, mine)
    differing = sorted({key for theirs in everyone for key in _differing_keys(mine, theirs)})
    if not differing:
        return
    shown = [
        f"  {key}: "
        + ", ".join(f"rank {r} {_flat(job).get(key, '<missing>')!r}" for r, job in enumerate(everyone))
        for key in differing[:_DIFFERENCES_SHOWN]
    ]
    raise RankLaunchError(
        "The ranks of this job, each started by the external launcher and each resolving the Hydra"
        " job on its own, disagree on it:\n" + "\n".join(shown) + "\nMake every process resolve the"
        " same values: no ${now:...} or random values in hydra.sweep.dir, hydra.run.dir or the config;"
        " use a value the launcher gives every process alike, e.g."
        " hydra.sweep.dir=multirun/${oc.env:SLURM_JOB_ID} or ${oc.env:TORCHELASTIC_RUN_ID}."
    )


def _resolved_job() -> dict:
    live = _live_job_config() if HydraConfig.initialized() else None
    return {
        "hydra.runtime.output_dir": HydraConfig.get().runtime.output_dir
        if HydraConfig.initialized()
        else None,
        "config": {} if live is None else _resolved_where_possible(live),
    }


def _flat(tree: Any, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, item in tree.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(tree, list):
        return {k: v for i, item in enumerate(tree) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


def _differing_keys(one: dict, other: dict) -> set:
    one, other = _flat(one), _flat(other)
    return {key for key in one.keys() | other.keys() if one.get(key) != other.get(key)}


@functools.lru_cache(maxsize=None)
def _strategies_for(namespace: str) -> types.SimpleNamespace:
    """Build HydraDDP and HydraFSDP on one Lightning namespace: each Trainer takes only its own."""
    try:
        lightning = importlib.import_module(_NAMESPACES[namespace])
    except ImportError as error:
        raise ImportError(
            f"hydra_fsdp.{namespace} needs the {_PIP_NAMES[namespace]} package, which is not installed:"
            f" pip install {_PIP_NAMES[namespace]}."
        ) from error
    where = "" if namespace == _default_namespace() else f"{namespace}."

    def build(name: str, mixin: type, base: type) -> type:
        attributes = {"__module__": __name__, "__qualname__": where + name, "__doc__": mixin.__doc__}
        return type(name, (mixin, base), dict(attributes, _lightning=lightning))

    return types.SimpleNamespace(
        HydraDDP=build("HydraDDP", _HydraDDP, lightning.strategies.DDPStrategy),
        HydraFSDP=build("HydraFSDP", _HydraFSDP, lightning.strategies.FSDPStrategy),
    )


@functools.lru_cache(maxsize=None)
def _default_namespace() -> str:
    for namespace, package in _NAMESPACES.items():
        if importlib.util.find_spec(package.split(".")[0]) is not None:
            return namespace
    raise ImportError(
        "hydra_fsdp needs Lightning, and neither pytorch-lightning nor lightning is installed:"
        " pip install pytorch-lightning (or lightning)."
    )


def __getattr__(name: str) -> Any:
    """Build the strategies on first use: importing hydra_fsdp imports no Lightning."""
    if name in _NAMESPACES:
        return _strategies_for(name)
    if name in ("HydraDDP", "HydraFSDP"):
        return getattr(_strategies_for(_default_namespace()), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- a child rank


def _run_child_rank(plan_path: str) -> None:
    """Run one child rank: its first stage from ``plan_path``, then, if warm, later jobs' stages.

    A warm child reads each next assignment from its stdin, one JSON line: the plan, rank 0's
    environment now (the new rendezvous port, the job's ``hydra.job.env_set``), the new job's
    log. A cold child's stdin is empty, so it exits after one.
    """
    _exit_with_parent()
    faulthandler.register(_STACK_DUMP_SIGNAL, all_threads=True)
    first = OmegaConf.load(plan_path)
    sys.path[:] = list(first.sys_path)
    sys.argv[:] = list(first.sys_argv)
    _import_launching_script(first.main)
    _run_stage(first)
    for line in sys.stdin:
        assignment = json.loads(line)
        _write_output_to(assignment["log"])
        os.environ.clear()
        os.environ.update(assignment["env"])
        _run_stage(OmegaConf.load(assignment["plan"]))
    # Done: exit now. At interpreter shutdown, torch's C++ threads (gloo, the process group an
    # FSDP module still holds) can abort the process and turn finished stages into a failure.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_stage(plan: DictConfig) -> None:
    """Rebuild the job as rank 0 saw it, check in, run rank 0's stage, say it is done."""
    os.chdir(plan.cwd)
    hydra_cfg = OmegaConf.create({"hydra": plan.hydra})
    OmegaConf.set_readonly(hydra_cfg, True)
    HydraConfig.instance().cfg = hydra_cfg
    _seed_like_rank_zero(importlib.import_module(plan.lightning))
    config = plan.config
    trainer = instantiate(config.trainer)
    module = instantiate(config[plan.module_key])
    stage_kwargs: dict = {"ckpt_path": plan.ckpt_path}
    if plan.datamodule:
        stage_kwargs["datamodule"] = instantiate(config[plan.datamodule_key])
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    store.set(_CHECK_IN_KEY.format(os.environ["LOCAL_RANK"]), "1")
    getattr(trainer, plan.stage)(module, **stage_kwargs)
    store.set(_DONE_KEY.format(os.environ["LOCAL_RANK"]), "1")
    del trainer, module, stage_kwargs
    gc.collect()  # a warm child holds nothing of this job while it waits for the next one
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _write_output_to(log: str) -> None:
    """Point this process's stdout and stderr at the new job's log."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log, "ab") as file:
        os.dup2(file.fileno(), sys.stdout.fileno())
        os.dup2(file.fileno(), sys.stderr.fileno())


def _seed_like_rank_zero(lightning: types.ModuleType) -> None:
    """Rank 0's ``seed_everything()`` ran in the task function, which children skip; it left the
    seed in the environment, so seed here, before the module is built, as rank 0 did."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    if seed is not None:
        lightning.seed_everything(int(seed), workers=os.environ.get("PL_SEED_WORKERS") == "1")


def _exit_with_parent() -> None:
    """End this child if rank 0 dies without ending it (SIGKILL, a crash): never an orphan."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="hydra-fsdp-parent-watch", daemon=True).start()


def _import_launching_script(main: DictConfig) -> None:
    """Import rank 0's ``__main__`` as multiprocessing's spawn does, so ``__main__.X`` resolves.

    Its ``if __name__ == "__main__":`` block does not run here.
    """
    if "module" in main:
        namespace = runpy.run_module(main.module, run_name="__mp_main__", alter_sys=False)
    elif "path" in main:
        namespace = runpy.run_path(main.path, run_name="__mp_main__")
    else:
        return
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


if __name__ == "__main__":
    _run_child_rank(sys.argv[1])
