"""Unit tests: a mocked ``subprocess.Popen`` (and sleep) pins what ``_rank_launch`` starts, and what
rank 0 refuses before starting anything. End-to-end tests with real processes are in tests/."""

import contextlib
import dataclasses
import fcntl
import functools
import importlib
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple
from unittest import mock

import hydra
import pytest
import pytorch_lightning as pl
import torch
from hydra.utils import instantiate
from hydra_zen import builds, launch, make_config, zen
from omegaconf import OmegaConf

import hydra_fsdp
from hydra_fsdp import ChildRankError, HydraDDP, HydraFSDP, RankLaunchError

# Lightning before 2.3.0 refuses FSDP without a GPU, and HydraFSDP then refuses to be built.
FSDP_ON_CPU = torch.cuda.is_available() or hydra_fsdp._release(pl.__version__) >= hydra_fsdp._release(
    next(need.lightning for need in hydra_fsdp._NEEDS if need.strategy == "HydraFSDP")
)
needs_fsdp_on_cpu = pytest.mark.skipif(
    not FSDP_ON_CPU,
    reason=f"Lightning {pl.__version__} refuses FSDP without a GPU: HydraFSDP refuses to be built (tested)",
)


class _StopAfterSpawn(ChildRankError):
    """Raised where rank 0 would wait for its children to check in: the launch ends there."""


class FitModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 2))


def fit_task(cfg):
    """A task function as users write them: children reach it by reference."""
    instantiate(cfg.trainer).fit(FitModule())


def launch_with_mocked_children(
    tmp_path, strategy, devices=3, env=None, config=None, task=fit_task, overrides=()
):
    """Run one Hydra job (in this process) whose fit() starts children into a mocked Popen.

    Returns (mocked Popen, mocked server start, mocked sleep, job dir, the job's error, what the first
    child was to read: the launch file, which the job's end removes). The children never check in:
    the job is stopped there, which also shows its cleanup.
    """
    if config is None:
        config = make_config(
            trainer=builds(
                pl.Trainer, accelerator="cpu", devices=devices, strategy=builds(strategy), logger=False
            ),
            module=builds(torch.nn.Linear, 2, 2),
        )
    env = {"HYDRA_FSDP_CLAIMS": str(tmp_path / "claims"), **(env or {})}  # the node's claims: the test's own
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(hydra_fsdp.subprocess, "Popen") as popen,
        mock.patch.object(hydra_fsdp._ForkServer, "start") as start,
        mock.patch.object(hydra_fsdp.time, "sleep") as sleep,
        mock.patch.object(hydra_fsdp._Job, "wait_until_checked_in", side_effect=_StopAfterSpawn),
    ):
        popen.return_value.poll.return_value = None  # the fork server runs
        start.return_value.poll.return_value = None  # and so does every child it starts
        start.return_value.pid = 4242
        launches = []
        start.side_effect = lambda command, *args, **kwargs: (
            launches.append(pickle.loads(Path(command[-1]).read_bytes())) or start.return_value
        )
        try:
            launch(
                config, task, overrides=[f"hydra.run.dir={tmp_path / 'job'}", *overrides], version_base="1.3"
            )
            error = None
        except BaseException as e:  # noqa: BLE001 - the job's error is what we test
            error = e
        finally:
            hydra_fsdp._sweep.fork_server = None
    return Launched(popen, start, sleep, tmp_path / "job", error, (launches or [None])[0])


class Launched(NamedTuple):
    popen: mock.Mock  # subprocess.Popen: it starts the fork server
    start: mock.Mock  # _ForkServer.start: the server starts each child rank
    sleep: mock.Mock
    job_dir: Path
    error: BaseException | None
    launch: dict | None  # what the first child read


@pytest.mark.parametrize("strategy", [HydraDDP, pytest.param(HydraFSDP, marks=needs_fsdp_on_cpu)])
def test_rank_launch_command_env_cwd_and_stagger(tmp_path, strategy):
    run = launch_with_mocked_children(tmp_path, strategy, devices=3, env={hydra_fsdp.LAUNCH_DELAY_ENV: "2.5"})
    assert isinstance(run.error, _StopAfterSpawn)
    config = run.job_dir / "rank_config.pickle"
    assert run.start.call_count == 2
    ports = set()
    for rank, call in zip((1, 2), run.start.call_args_list):
        command, env, log = call.args
        assert command == [sys.executable, os.path.abspath(hydra_fsdp.__file__), str(config)]
        assert env["LOCAL_RANK"] == str(rank)
        assert (env["NODE_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "3", "127.0.0.1")
        assert env["PYTHONUNBUFFERED"] == "1" and env["HYDRA_FSDP_CONFIG"] == str(config)
        assert env["PATH"] == os.environ["PATH"]  # the rest of rank 0's environment
        ports.add(env["MASTER_PORT"])
        assert log == run.job_dir / f"rank_{rank}.log"
    assert len(ports) == 1
    assert [c for c in run.sleep.call_args_list if c.args == (2.5,)] == [mock.call(2.5)]  # between the two
    assert run.launch["cwd"] == os.getcwd()  # the job's working directory (Hydra 1.3: it does not chdir)
    assert not config.exists()  # the job's end removed it
    # the job cleaned up: children killed and reaped, rank 0's environment as it was
    assert run.start.return_value.kill.called
    for key in hydra_fsdp._RENDEZVOUS_ENV:
        assert key not in os.environ
    assert hydra_fsdp._sweep.job is None and not torch.distributed.is_initialized()


def test_the_fork_server_is_started_once_clean_of_the_job(tmp_path):
    run = launch_with_mocked_children(
        tmp_path, HydraDDP, devices=3, overrides=["+hydra.job.env_set.JOB_ONLY=1"]
    )
    (call,) = run.popen.call_args_list  # one server, however many children
    assert call.args[0] == [sys.executable, os.path.abspath(hydra_fsdp.__file__)]
    env = call.kwargs["env"]
    server = json.loads(env["HYDRA_FSDP_FORK_SERVER"])
    assert server == {
        "sys_path": sys.path,
        "module": "hydra_fsdp",
        "imports": ["pytorch_lightning", "hydra_zen"],
        "fd": server["fd"],  # its end of the owner's connection
    }
    assert env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"  # a CUDA query never initialises CUDA there
    assert "JOB_ONLY" not in env and env["PATH"] == os.environ["PATH"]  # env_set is the children's own
    assert all(c.args[1]["JOB_ONLY"] == "1" for c in run.start.call_args_list)
    # What it prints goes to rank 0's stderr; its replies, on connections of their own, are never mixed in.
    assert (call.kwargs["stdin"], call.kwargs["stdout"]) == (subprocess.DEVNULL, 2)
    assert call.kwargs["pass_fds"] == [server["fd"]]


def test_the_child_gets_the_task_function_and_where_rank0_stands(tmp_path):
    run = launch_with_mocked_children(tmp_path, HydraDDP, devices=2)
    saved = run.launch
    assert pickle.loads(saved["task"]) is fit_task
    assert saved["module"] == "hydra_fsdp" and saved["cwd"] == os.getcwd() and saved["sys_path"] == sys.path
    assert saved["hydra"]["runtime"]["output_dir"] == str(run.job_dir)
    config = pickle.loads(saved["config"])  # the config as the task function got it, flags included
    assert (
        hydra_fsdp.OmegaConf.is_struct(config)
        and "hydra" not in config
        and list(config.module._args_) == [2, 2]
    )
    assert (
        hydra_fsdp.OmegaConf.get_type(config, "module").__qualname__ == "Builds_Linear"
    )  # hydra-zen's, made again


def test_no_stagger_for_a_single_child(tmp_path):
    run = launch_with_mocked_children(tmp_path, HydraDDP, devices=2)
    assert run.start.call_count == 1
    assert mock.call(1.0) not in run.sleep.call_args_list


def test_stagger_zero_disables_it(tmp_path):
    run = launch_with_mocked_children(tmp_path, HydraDDP, devices=4, env={hydra_fsdp.LAUNCH_DELAY_ENV: "0"})
    assert run.start.call_count == 3
    assert mock.call(0.0) not in run.sleep.call_args_list and mock.call(1.0) not in run.sleep.call_args_list


def test_stagger_default_is_one_second(tmp_path, monkeypatch):
    monkeypatch.delenv(hydra_fsdp.LAUNCH_DELAY_ENV, raising=False)
    assert hydra_fsdp._launch_delay() == 1.0
    run = launch_with_mocked_children(tmp_path, HydraDDP, devices=4)
    assert run.start.call_count == 3
    assert [c for c in run.sleep.call_args_list if c.args == (1.0,)] == [mock.call(1.0)] * 2
    monkeypatch.setenv(hydra_fsdp.LAUNCH_DELAY_ENV, "0.25")
    assert hydra_fsdp._launch_delay() == 0.25


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "", "1s"])
def test_bad_stagger_fails_before_any_start(tmp_path, value):
    run = launch_with_mocked_children(tmp_path, HydraDDP, env={hydra_fsdp.LAUNCH_DELAY_ENV: value})
    assert isinstance(run.error, RankLaunchError)
    assert hydra_fsdp.LAUNCH_DELAY_ENV in str(run.error) and repr(value) in str(run.error)
    run.popen.assert_not_called()
    run.start.assert_not_called()
    assert hydra_fsdp._sweep.job is None


def test_output_subdir_null_launches_from_the_job_dir_and_makes_no_hydra_dir(tmp_path):
    run = launch_with_mocked_children(
        tmp_path, HydraFSDP if FSDP_ON_CPU else HydraDDP, devices=2, overrides=["hydra.output_subdir=null"]
    )
    assert isinstance(run.error, _StopAfterSpawn)
    (call,) = run.start.call_args_list
    assert call.args[0][-1] == str(run.job_dir / "rank_config.pickle") and run.launch["config"]
    assert [p.name for p in run.job_dir.iterdir()] == ["zen_launch.log"]  # no .hydra; the launch file removed


def test_outside_a_hydra_job_is_a_clear_error():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HydraDDP(), logger=False)
    with (
        mock.patch.object(hydra_fsdp.subprocess, "Popen") as popen,
        pytest.raises(RankLaunchError, match="no Hydra job"),
    ):
        trainer.fit(FitModule())
    popen.assert_not_called()


# --------------------------------------------------------------------------- how the task reaches a child


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def decorated_main(cfg):
    """What @hydra.main hands Hydra is this function undecorated; the module's name is the wrapper."""


def _logged(function):
    @functools.wraps(function)
    def wrapper(cfg):
        return function(cfg)

    return wrapper


@_logged
@_logged
def twice_decorated(cfg):
    pass


@pytest.mark.parametrize(
    "task",
    [fit_task, decorated_main.__wrapped__, twice_decorated.__wrapped__.__wrapped__, zen(FitModule)],
    ids=["function", "@hydra.main", "two decorators", "zen"],
)
def test_task_functions_reach_a_child_by_reference(task):
    pickled, why_not, _ = hydra_fsdp._pickled(task, "the task function")
    assert why_not == ""
    unpickled = pickle.loads(pickled)
    if isinstance(task, type(zen(FitModule))):
        assert unpickled.func is FitModule
    else:
        assert unpickled is task
    assert len(pickled) < 500, "by reference: names, not code"


def test_a_closure_or_lambda_cannot_reach_a_child():
    def closure(cfg):
        pass

    for task in (closure, lambda cfg: None):
        pickled, why_not, _ = hydra_fsdp._pickled(task, "the task function")
        assert pickled is None and "cannot be pickled by reference" in why_not


def test_a_task_of_an_interactive_session_cannot_reach_a_child(monkeypatch):
    def typed_in(cfg):
        pass

    typed_in.__module__, typed_in.__qualname__ = "__main__", "typed_in"
    monkeypatch.setattr(sys.modules["__main__"], "typed_in", typed_in, raising=False)
    monkeypatch.setattr(hydra_fsdp, "_launching_script", dict)  # what `python -i`, Jupyter give
    pickled, why_not, _ = hydra_fsdp._pickled(typed_in, "the task function")
    assert pickled is None and "__main__.typed_in, of an interactive session" in why_not


def test_fallback_is_one_logged_line_and_starts_children(tmp_path, capsys):
    run = launch_with_mocked_children(tmp_path, HydraDDP, devices=2, task=lambda cfg: fit_task(cfg))
    assert isinstance(run.error, _StopAfterSpawn) and run.start.call_count == 1
    logged = capsys.readouterr().out  # Hydra's job logging writes to the console
    lines = [line for line in logged.splitlines() if "[hydra_fsdp]" in line]
    assert len(lines) == 1 and "[WARNING]" in lines[0] and "build the config's trainer and module" in lines[0]
    saved = run.launch
    assert saved["task"] is None and saved["contract"] == {
        "module_key": "module",
        "datamodule_key": "datamodule",
    }


def test_fallback_without_the_module_in_the_config_fails_naming_file_and_key(tmp_path):
    config = make_config(trainer=builds(pl.Trainer, accelerator="cpu", devices=2, strategy=builds(HydraDDP)))
    run = launch_with_mocked_children(tmp_path, HydraDDP, config=config, task=lambda cfg: fit_task(cfg))
    assert isinstance(run.error, RankLaunchError)
    message = str(run.error)
    assert "the job's config has no 'module' key (it has: trainer)" in message
    assert "module_key='model'" in message and "cannot be pickled by reference" in message
    run.start.assert_not_called()


def test_a_job_store_on_a_port_an_earlier_job_had_is_the_one_init_process_group_finds():
    # The OS offers a port again after tens of jobs (6 to 160 seen here). torch's cache of multi-tenant
    # stores still holds the earlier job's dead store for that port, and keeps it over a server opened
    # the port-0 way: init_process_group's lookup by the port's number then misses the job's store and
    # starts a second server there (EADDRINUSE). A job's store is opened by its port's number.
    real_store = torch.distributed.TCPStore
    port = hydra_fsdp._sweep.new_store("127.0.0.1").port  # the job ended: its store is dead, and cached
    missed = real_store("127.0.0.1", port, is_master=True, wait_for_workers=False)  # one the cache misses
    with pytest.raises(torch.distributed.DistNetworkError, match="EADDRINUSE|Address already in use"):
        real_store("127.0.0.1", port, is_master=True, multi_tenant=True)  # as init_process_group looks
    del missed
    real_store("127.0.0.1", port, is_master=True, multi_tenant=True)  # dead, and cached again

    offers = iter([lambda address, _port, **kwargs: real_store(address, port, **kwargs)])  # that port again
    with mock.patch.object(
        hydra_fsdp.torch.distributed,
        "TCPStore",
        side_effect=lambda *a, **k: next(offers, real_store)(*a, **k),
    ) as made:
        store = hydra_fsdp._sweep.new_store("127.0.0.1")
    assert made.call_count == 2 and store.port == port
    lookup = real_store("127.0.0.1", store.port, is_master=True, multi_tenant=True, wait_for_workers=False)
    lookup.set("job", "mine")
    assert store.get("job") == b"mine"  # init_process_group finds the job's own store


class SmallPortRange:
    """``TCPStore`` as the OS and torch's cache of multi-tenant stores give them out, on 3 ports: port 0
    binds a free one and the cache keeps the first store of each port (a dead one included) until a
    lookup of that port by its number drops it, as init_process_group's does."""

    def __init__(self):
        self.bound, self.cache = set(), {}

    def __call__(self, address, port, *, is_master, multi_tenant=False, wait_for_workers=True):
        # A lookup by number: the port's live store, else its dead one dropped
        if port and multi_tenant and (cached := self.cache.pop(port, lambda: None)()) is not None:
            self.cache[port] = weakref.ref(cached)
            return cached
        if port in self.bound or (port == 0 and len(self.bound) == 3):
            raise torch.distributed.DistNetworkError(f"EADDRINUSE: port {port or 'of those free'}")
        store = self.Store(port or min({50000, 50001, 50002} - self.bound), self.bound)
        if multi_tenant:
            self.cache.setdefault(store.port, weakref.ref(store))
        return store

    class Store:
        def __init__(self, port, bound):
            self.port, self.bound = port, bound
            bound.add(port)

        def __del__(self):
            self.bound.discard(self.port)


def test_a_sweep_reuses_the_ports_of_ended_jobs(monkeypatch):
    """The OS has some 28,000 ports to offer; a sweep that took each port once only failed every job after
    that many. A port an earlier job had is reused, and init_process_group finds the job's store on it."""
    tcp_stores = SmallPortRange()
    monkeypatch.setattr(hydra_fsdp.torch.distributed, "TCPStore", tcp_stores)
    sweep = hydra_fsdp._Sweep()
    for job in range(10):
        try:
            store = sweep.new_store("127.0.0.1")
        except torch.distributed.DistNetworkError as error:
            pytest.fail(f"job {job} of a sweep on 3 ports found none: {error}")
        lookup = tcp_stores("127.0.0.1", store.port, is_master=True, multi_tenant=True)
        assert lookup is store, "init_process_group would start a second server on the job's port"
        del store, lookup  # the job ended


# --------------------------------------------------------------------------- torchrun / SLURM


def test_external_launcher_spawns_nothing():
    env = {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "2"}
    with mock.patch.dict(os.environ, env), mock.patch.object(hydra_fsdp.subprocess, "Popen") as popen:
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HydraDDP(), logger=False)
        assert trainer.strategy.cluster_environment.creates_processes_externally
        assert trainer.strategy.launcher.launch(lambda: "ran", trainer=trainer) == "ran"
    popen.assert_not_called()


def test_external_world_size_mismatch_is_a_clear_error():
    env = {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "3"}
    with mock.patch.dict(os.environ, env):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HydraDDP(), logger=False)
        with pytest.raises(RankLaunchError, match=r"3 .*2"):
            trainer.strategy.launcher.launch(lambda: "ran", trainer=trainer)


@pytest.mark.parametrize(
    "text", ["plain", "a${b}", "x\\${y}", "\\\\${z}", "dir/a=1,b=[2,3],c=${d}\\e f", "end\\", "$ {x}", "${"]
)
def test_escaped_strings_read_back_literally(text):
    config = hydra_fsdp.OmegaConf.create({"value": hydra_fsdp._resolved_where_possible(text)})
    assert config.value == text


# --------------------------------------------------------------------------- whichever Lightning


def python(code):
    """Run ``code`` in a fresh interpreter, where nothing else decides what is imported."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


@pytest.mark.parametrize(
    "lightning, namespace", [("lightning.pytorch", "lightning"), ("pytorch_lightning", "pytorch_lightning")]
)
def test_plain_names_build_the_strategy_of_the_lightning_in_use(lightning, namespace):
    out = python(f"""
import pickle, sys, {lightning} as L, hydra_fsdp
for name in ("HydraDDP", "HydraFSDP") if {FSDP_ON_CPU} else ("HydraDDP",):
    strategy = getattr(hydra_fsdp, name)(rank_timeout=5)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # its Trainer takes it
    copy = pickle.loads(pickle.dumps(strategy))
    print(type(strategy).__qualname__, isinstance(strategy, getattr(hydra_fsdp, name)),
          type(copy) is type(strategy), copy.rank_timeout)
print(isinstance(hydra_fsdp.HydraFSDP() if {FSDP_ON_CPU} else object(), hydra_fsdp.HydraDDP),
      sorted(m for m in ("lightning", "pytorch_lightning") if m in sys.modules))
""")
    fsdp = [f"{namespace}.HydraFSDP", "True", "True", "5"] if FSDP_ON_CPU else []
    assert out == [f"{namespace}.HydraDDP", "True", "True", "5", *fsdp,
                   "False", f"['{lightning.split('.')[0]}']"]  # fmt: skip


def test_with_both_lightnings_imported_the_mismatch_error_names_both_spellings():
    out = " ".join(
        python("""
import pytorch_lightning, lightning.pytorch as L, hydra_fsdp
try:
    L.Trainer(strategy=hydra_fsdp.HydraDDP(), accelerator="cpu", devices=2)
except Exception as error:
    print(error)
""")
    )
    assert "hydra_fsdp.lightning.HydraDDP for a lightning.pytorch.Trainer" in out, out
    assert "hydra_fsdp.pytorch_lightning.HydraDDP for a pytorch_lightning.Trainer" in out, out


# --------------------------------------------------------------------------- private names, guarded
# Each test simulates the change upstream that its guard is for: a clear error, never a hang.

UPSTREAM_CHANGED = r"private to its package.*Known to work: torch"


def test_guard_run_job_locals(monkeypatch):
    def run_job(task, config):  # a Hydra whose run_job (1.4: _run_job) names its locals otherwise
        return hydra_fsdp._hydra_job()

    body = "_run_job" if hasattr(hydra.core.utils, "_run_job") else "run_job"
    monkeypatch.setattr(hydra.core.utils, body, run_job)
    with pytest.raises(
        RankLaunchError, match=f"local variables of hydra.core.utils.{body}.*" + UPSTREAM_CHANGED
    ):
        run_job(fit_task, None)


def test_a_child_rank_finds_the_job_it_runs_by_its_record_not_by_the_names_of_locals():
    """A child finds its job in what ``_run_child_rank`` recorded (``_child_job``), so that renaming one of
    that function's local variables cannot break it with an error that blames Hydra's run_job."""
    job = {"task_function": fit_task, "task_cfg": hydra_fsdp.OmegaConf.create({"lr": 0.1})}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hydra_fsdp, "_child_job", job)
        assert hydra_fsdp._hydra_job() is job
    assert hydra_fsdp._hydra_job() is None, "outside a job, and outside a child rank: no job"


def test_guard_hydra_callbacks_list():
    hydra_context = SimpleNamespace(callbacks=SimpleNamespace(callback_list=[]))  # renamed upstream
    with pytest.raises(RankLaunchError, match=r"hydra_context\.callbacks\.callbacks.*" + UPSTREAM_CHANGED):
        hydra_fsdp._sweep.follow(hydra_context)


def test_guard_hydra_config_assignment(monkeypatch):
    monkeypatch.setattr(hydra_fsdp.HydraConfig, "get", staticmethod(lambda: None))  # reads elsewhere now
    with pytest.raises(RankLaunchError, match=r"HydraConfig\.instance\(\)\.cfg.*" + UPSTREAM_CHANGED):
        hydra_fsdp._set_hydra_config({"runtime": {"output_dir": "/tmp"}})


def test_guard_job_return_value(capsys):
    """JobReturn._return_value gone: the note on the ended children is printed, not attached."""
    hydra_fsdp._add_note(None, "Rank 0 failed while these child ranks were still running")
    assert "child ranks were still running" in capsys.readouterr().err


def test_guard_torch_group_count(monkeypatch):
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_world", SimpleNamespace(default_pg=None))
    with pytest.raises(RankLaunchError, match=r"_world\.group_count.*" + UPSTREAM_CHANGED):
        hydra_fsdp._destroy_process_group()


def test_guard_lightning_setup_model(monkeypatch):
    monkeypatch.delattr(
        pl.strategies.FSDPStrategy, "_setup_model"
    )  # Strategy's own, which wraps nothing, left
    with pytest.raises(RankLaunchError, match=r"FSDPStrategy\._setup_model.*" + UPSTREAM_CHANGED):
        hydra_fsdp._strategies_for.__wrapped__("pytorch_lightning")


@needs_fsdp_on_cpu
def test_guard_lightning_state_dict_type(monkeypatch):
    init = pl.strategies.FSDPStrategy.__init__

    def renamed(self, *args, state_dict_type="full", **kwargs):
        init(self, *args, state_dict_type=state_dict_type, **kwargs)
        self.checkpoint_layout = self.__dict__.pop("_state_dict_type")

    monkeypatch.setattr(pl.strategies.FSDPStrategy, "__init__", renamed)
    with pytest.raises(RankLaunchError, match=r"FSDPStrategy\._state_dict_type.*" + UPSTREAM_CHANGED):
        hydra_fsdp.pytorch_lightning.HydraFSDP()


def test_guard_lightning_rank_zero_only(monkeypatch):
    monkeypatch.delattr(pl.utilities.rank_zero.rank_zero_only, "rank")
    with pytest.raises(RankLaunchError, match=r"rank_zero_only\.rank.*" + UPSTREAM_CHANGED):
        hydra_fsdp._set_rank_zero_only("pytorch_lightning", 1)


def test_guard_lightning_sharded_metadata_name(tmp_path):
    (tmp_path / "meta.pth").write_bytes(b"")  # renamed upstream
    with pytest.raises(RankLaunchError, match=r"meta\.pt.*" + UPSTREAM_CHANGED):
        hydra_fsdp._metadata_file(tmp_path)


def test_guard_fsdp_wrapped_module_name():
    """A parameter of the hyperparameters' net that the state dict has under no name FSDP would give
    it (FSDP's wrapper name changed): the save fails, rather than pickle rank 0's shard silently."""
    net = torch.nn.Linear(2, 1)
    root = torch.nn.ModuleDict({"net": net})
    state_dict = {"net._fsdp_v2_wrapped.weight": net.weight, "net._fsdp_v2_wrapped.bias": net.bias}
    with (
        pytest.raises(RankLaunchError, match=r"FSDP's name for a wrapped module.*" + UPSTREAM_CHANGED),
        hydra_fsdp._unsharded_while_pickled([net], state_dict, root),
    ):
        pass
    full = {"net.weight": torch.ones(1, 2), "net.bias": torch.zeros(1)}
    with hydra_fsdp._unsharded_while_pickled([net], full, root):
        assert torch.equal(net.weight, full["net.weight"])
    assert not torch.equal(net.weight.data, full["net.weight"]), "the module's own tensors are back"


@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"rank_timeout": "abc"}, "rank_timeout='abc'"),
        ({"rank_timeout": -5}, "rank_timeout=-5"),
        ({"rank_timeout": 0}, "rank_timeout=0"),
        ({"rank_timeout": float("nan")}, "rank_timeout=nan"),
        ({"module_key": ""}, "module_key=''"),
        ({"datamodule_key": None}, "datamodule_key=None"),
        ({"shutdown_grace": -1}, "shutdown_grace=-1"),
        ({"shutdown_grace": "30"}, "shutdown_grace='30'"),
        ({"shutdown_grace": True}, "shutdown_grace=True"),
        ({"shutdown_grace": float("nan")}, "shutdown_grace=nan"),
    ],
)
@pytest.mark.parametrize("strategy", [HydraDDP, HydraFSDP])
def test_bad_strategy_arguments_fail_at_construction_naming_them(strategy, arguments, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        strategy(**arguments)


def test_rank_timeout_from_yaml_may_be_an_int():
    strategy = instantiate(OmegaConf.create("_target_: hydra_fsdp.HydraDDP\nrank_timeout: 30\n"))
    assert isinstance(strategy, HydraDDP) and strategy.rank_timeout == 30


def test_shutdown_grace_is_the_argument_else_the_environment_else_30(monkeypatch):
    monkeypatch.delenv(hydra_fsdp.SHUTDOWN_GRACE_ENV, raising=False)
    assert HydraDDP().shutdown_grace == 30
    monkeypatch.setenv(hydra_fsdp.SHUTDOWN_GRACE_ENV, "7.5")
    assert HydraDDP().shutdown_grace == 7.5
    assert HydraDDP(shutdown_grace=0).shutdown_grace == 0  # the argument wins
    monkeypatch.setenv(hydra_fsdp.SHUTDOWN_GRACE_ENV, "soon")
    with pytest.raises(RankLaunchError, match="MUSHIN_DDP_SHUTDOWN_GRACE='soon' is not a number of seconds"):
        HydraDDP()
    assert HydraDDP(shutdown_grace=5).shutdown_grace == 5  # a bad variable is not read where unused


# --------------------------------------------------------------------------- the releases it runs on


@pytest.mark.parametrize(
    "module, name, old, needed",
    [(torch, "torch", "2.2.2+cpu", "torch>=2.3"), (hydra, "hydra-core", "1.2.0", "hydra-core>=1.3.0"),
     (pl, "pytorch-lightning", "2.1.4", "pytorch-lightning>=2.2")],
)  # fmt: skip
@pytest.mark.parametrize("strategy", ["HydraDDP", "HydraFSDP"])
def test_a_release_older_than_the_minimum_is_refused_naming_it(
    monkeypatch, module, name, old, needed, strategy
):
    monkeypatch.setattr(module, "__version__", old)
    with pytest.raises(
        ImportError,
        match=re.escape(f"needs {needed} (found {old})") + ".*" + re.escape(f"pip install '{needed}'"),
    ):
        getattr(hydra_fsdp.pytorch_lightning, strategy)()


def test_versions_are_read_by_their_release_numbers():
    assert hydra_fsdp._release("2.3.0+cu121") == (2, 3, 0) >= hydra_fsdp._release("2.3")
    assert hydra_fsdp._release("2.2.0.post0") == (2, 2, 0) < hydra_fsdp._release("2.10")
    assert hydra_fsdp._release("1.3.0.dev2") >= hydra_fsdp._release("1.3.0")


def test_fsdp_without_a_gpu_on_a_lightning_that_refuses_it_names_the_release_needed(monkeypatch):
    monkeypatch.setattr(pl, "__version__", "2.2.5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ImportError, match=r"HydraFSDP without a GPU needs pytorch-lightning>=2\.3\.0 \(found 2\.2\.5"
    ):
        hydra_fsdp.pytorch_lightning.HydraFSDP()
    hydra_fsdp.pytorch_lightning.HydraDDP()  # DDP runs on the CPU there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    hydra_fsdp.pytorch_lightning.HydraFSDP()  # and FSDP on a GPU


def test_model_parallel_on_releases_without_it_is_refused_naming_what_it_needs(monkeypatch):
    found = {"pytorch-lightning": pl.__version__, "torch": torch.__version__}
    too_old = [name for name, release in found.items() if hydra_fsdp._release(release) < (2, 4)]
    if too_old:  # the floor stack (Lightning 2.2, torch 2.3): the real refusal
        with pytest.raises(ImportError, match=rf"HydraModelParallel needs {too_old[0]}>=2\.4 \(found"):
            hydra_fsdp.HydraModelParallel(data_parallel_size=2)
        return
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "__version__", "2.10.0+cpu")
    hydra_fsdp.HydraModelParallel(data_parallel_size=2)
    monkeypatch.setattr(pl, "__version__", "2.3.3")
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    with pytest.raises(ImportError) as refused:
        hydra_fsdp.pytorch_lightning.HydraModelParallel()
    assert str(refused.value) == (
        "HydraModelParallel needs pytorch-lightning>=2.4 (found 2.3.3), torch>=2.4 (found 2.3.1):"
        " pip install 'pytorch-lightning>=2.4' 'torch>=2.4', or use HydraDDP."
    )


def test_the_fabric_strategies_refuse_old_releases_naming_fabrics_package(monkeypatch):
    """The same refusals for a Fabric, naming what to install: pytorch-lightning for lightning_fabric (its
    wheel holds it, at its release), or lightning."""
    package = hydra_fsdp.fabric.HydraDDP._lightning.__name__.split(".")[0]
    name = {"lightning_fabric": "pytorch-lightning", "lightning": "lightning"}[package]
    monkeypatch.setattr(sys.modules[package], "__version__", "2.1.4")
    with pytest.raises(
        ImportError, match=re.escape(f"needs {name}>=2.2 (found 2.1.4): pip install '{name}>=2.2'")
    ):
        hydra_fsdp.fabric.HydraDDP()
    monkeypatch.setattr(sys.modules[package], "__version__", "2.3.3")
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    with pytest.raises(ImportError) as refused:
        hydra_fsdp.fabric.HydraModelParallel()
    assert str(refused.value) == (
        f"HydraModelParallel needs {name}>=2.4 (found 2.3.3), torch>=2.4 (found 2.3.1):"
        f" pip install '{name}>=2.4' 'torch>=2.4', or use HydraDDP."
    )


def test_fsdp2_without_a_gpu_on_a_torch_that_cannot_train_it_over_gloo_is_refused(monkeypatch):
    # torch 2.4 to 2.6: fully_shard fails without CUDA streams; 2.7 to 2.9: gloo's AVG sums (docs/design.md)
    if hydra_fsdp._release(pl.__version__) < (2, 4):
        pytest.skip(f"Lightning {pl.__version__} has no ModelParallelStrategy (refused: tested above)")
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ImportError) as refused:
        hydra_fsdp.pytorch_lightning.HydraModelParallel(data_parallel_size=2)
    assert str(refused.value) == (
        "HydraModelParallel without a GPU needs torch>=2.10 (found 2.9.1+cu128): pip install 'torch>=2.10',"
        " or use HydraDDP."
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    hydra_fsdp.pytorch_lightning.HydraModelParallel(data_parallel_size=2)  # on a GPU, torch 2.4 does


LAUNCHERS = ("hydra-joblib-launcher", "hydra-submitit-launcher")


def test_the_floors_agree_in_pyproject_the_floor_stack_and_the_module():
    """pyproject.toml's floors are what .ci/floor.txt pins (CI runs them) and what the module checks."""
    root = Path(__file__).parent
    release = hydra_fsdp._release
    declared = {
        n: release(v) for n, v in re.findall(r'"([a-z-]+)>=([\d.]+)', (root / "pyproject.toml").read_text())
    }
    floor = (root / ".ci" / "floor.txt").read_text()
    pinned = {n: release(v) for n, v in re.findall(r"^([A-Za-z_-]+)==([\d.]+)", floor, re.MULTILINE)}
    for name in ("torch", "pytorch-lightning", "lightning", "hydra-core", "hydra-zen", "pytest") + LAUNCHERS:
        assert pinned[name][: len(declared[name])] == declared[name], name
    for name, minimum in hydra_fsdp._MINIMUM_VERSIONS.items():
        assert declared[name] == release(minimum)[: len(declared[name])], name


def test_a_keyboard_interrupt_in_a_stage_stops_the_sweep_as_sigint_does():
    # Ctrl-C's handler can run before the signal thread sees it; Lightning < 2.3 then swallows the
    # KeyboardInterrupt, and without this the sweep went on to its next job
    job = mock.Mock(started=time.monotonic())
    job.children.stopped_by = None
    job.children.close.return_value = []
    error = hydra_fsdp._Job.error_for(job, KeyboardInterrupt())
    assert isinstance(error, SystemExit) and error.code == 128 + signal.SIGINT
    # the children get SIGINT and their grace (close), not SIGKILL at once
    job.children.close.assert_called_once_with(signal.SIGINT, job.spec.shutdown_grace)


class _Child:
    """A child rank as rank 0 sees it (``_ForkedChild``'s part): what it was sent; it exits on the
    signals in ``exits_on``, and on SIGKILL."""

    def __init__(self, said, exits_on=()):
        self.pid, self.said, self.exits_on, self.sent, self.code = -1, said, exits_on, [], None

    def send_signal(self, signum):
        self.sent.append(signum)
        if signum in (*self.exits_on, signal.SIGKILL) and self.code is None:
            with self.said:
                self.code = 1 if signum != signal.SIGKILL else -signum
                self.said.notify_all()

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def poll(self):
        return self.code

    def wait(self, timeout=None):
        return self.code


def test_a_signal_reaches_each_child_once_and_a_second_one_kills_them_at_once(tmp_path):
    # One SIGTERM is reported twice (the watch thread, Lightning's handler by launcher.kill); a second
    # Ctrl-C, which only the watch thread counts, ends everything at once
    children = hydra_fsdp._ChildRanks(tmp_path, threading.Condition())
    child = _Child(children.said)
    children.add(1, child)
    children.stop(signal.SIGINT, grace=60)  # the watch thread
    children.stop(signal.SIGINT, grace=60)  # Lightning's handler, or the job's close: the same signal
    assert child.sent == [signal.SIGINT] and children.stopped_by == signal.SIGINT
    children.stop(signal.SIGINT, grace=60, again=True)  # a second Ctrl-C
    assert child.sent == [signal.SIGINT, signal.SIGKILL]


def test_close_gives_the_children_the_grace_then_kills_and_names_the_rest(tmp_path):
    children = hydra_fsdp._ChildRanks(tmp_path, threading.Condition())
    graceful, stuck = _Child(children.said, exits_on=[signal.SIGTERM]), _Child(children.said)
    children.add(1, graceful)
    children.add(2, stuck)
    started = time.monotonic()
    assert children.close(signal.SIGTERM, 0.5) == [2]
    assert 0.5 <= time.monotonic() - started < 5
    # then SIGKILL, by the grace's thread and by close (the fork server kills none it has reaped)
    assert graceful.sent[0] == signal.SIGTERM and set(graceful.sent[1:]) == {signal.SIGKILL}
    assert stuck.sent[0] == signal.SIGTERM and set(stuck.sent[1:]) == {signal.SIGKILL}
    assert graceful.code == 1 and stuck.code == -signal.SIGKILL  # the one had exited by itself
    started = time.monotonic()
    children.end()  # the job's later end: the grace is over, nothing waits
    assert time.monotonic() - started < 0.5


def test_a_second_ctrl_c_during_the_grace_kills_the_children_at_once(tmp_path):
    # rank 0's main thread waits in close() for the grace; a second Ctrl-C raises KeyboardInterrupt there
    children = hydra_fsdp._ChildRanks(tmp_path, threading.Condition())
    stuck = _Child(children.said)
    children.add(1, stuck)
    second = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    second.start()
    try:
        killed = children.close(signal.SIGINT, 60)
    except KeyboardInterrupt:  # not pytest's to stop the run on
        pytest.fail("the second Ctrl-C's KeyboardInterrupt escaped close(), the children left to the grace")
    assert killed == [1]
    assert time.monotonic() - started < 5, "the second Ctrl-C did not cut the grace short"
    assert stuck.sent[:2] == [signal.SIGINT, signal.SIGKILL]


def test_a_child_that_outlives_sigkill_is_not_waited_for_forever(tmp_path, monkeypatch, caplog):
    # How a child in uninterruptible sleep (a hung driver, a dead file system) looks from rank 0: SIGKILL
    # sent, and the fork server never reports its exit. Rank 0 is the sweep: it may wait, but not forever.
    monkeypatch.setattr(hydra_fsdp, "_KILL_WAIT", 0.2)
    sleeper = subprocess.Popen(["sleep", "60"])
    server = SimpleNamespace(exit_codes={}, lost=False, said=threading.Condition())  # it never says
    server.send_signal = lambda pid, signum: sleeper.poll() is None and os.kill(pid, signum)
    children = hydra_fsdp._ChildRanks(tmp_path, server.said)
    children.add(1, hydra_fsdp._ForkedChild(server, sleeper.pid))
    try:
        ending = threading.Thread(target=children.end, daemon=True)
        ending.start()
        ending.join(timeout=10)
        assert not ending.is_alive(), "rank 0 waits without a bound for a child that outlived SIGKILL"
        assert sleeper.wait(timeout=5) == -signal.SIGKILL, "it was sent SIGKILL all the same"
        assert f"child rank 1 (pid {sleeper.pid}) is still there" in caplog.text
        started = time.monotonic()
        children.end()  # the job's later ends do not wait for it again
        assert time.monotonic() - started < 0.1
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_sigterm_to_a_fork_of_rank_0_is_not_rank_0s():
    """A fork of rank 0 (a DataLoader worker, a Pool's) kept the watch's wakeup fd and SIGTERM handler:
    torch's SIGTERM to a worker that does not join in time reached the watcher, which killed the job's
    ranks; and close() waited, without a bound, for every process holding the wakeup pipe to exit."""
    on_signal = mock.Mock()
    watch = hydra_fsdp._SignalWatch(on_signal)
    assert watch.thread is not None, "no watch here: not the main thread, or another wakeup fd is set"
    forked, (ready, say_ready) = None, os.pipe()
    try:
        forked = os.fork()
        if forked == 0:
            try:
                os.write(say_ready, b"1")  # after the fork's hooks
                time.sleep(30)
            finally:
                os._exit(0)
        os.read(ready, 1)
        os.kill(forked, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not (ended := os.waitpid(forked, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        forked = None if ended[0] else forked
        time.sleep(0.3)  # time for the watcher to hear of a wakeup byte
        on_signal.assert_not_called()
        assert os.waitstatus_to_exitcode(ended[1]) == -signal.SIGTERM  # SIGTERM's default, as forked
        # A copy of the pipe that a process keeps, as a fork made past Python's (a C library's) would
        holder = subprocess.Popen(["sleep", "5"], pass_fds=[watch.write_fd])
        started = time.monotonic()
        watch.close()
        took = time.monotonic() - started
        holder.kill()
        holder.wait()
        assert took < 3, f"close() waited {took:.1f} s, until every process holding the wakeup pipe ended"
    finally:
        if forked:
            os.kill(forked, signal.SIGKILL)
            os.waitpid(forked, 0)
        watch.close()
        os.close(ready)
        os.close(say_ready)


class _TellsWhenWaitedOn:
    """A re-entrant lock that tells (``waited_on``) when a thread has to wait for it."""

    def __init__(self):
        self.lock, self.waited_on = threading.RLock(), threading.Event()

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.waited_on.set()
            self.lock.acquire()

    def __exit__(self, *exc_info):
        self.lock.release()


def test_a_signal_while_children_are_being_started_ends_every_one(tmp_path):
    # The signal thread kills the children while _rank_launch, on the main thread, adds the next one.
    first, second = mock.Mock(pid=101), mock.Mock(pid=102)
    children = hydra_fsdp._ChildRanks(tmp_path, threading.Condition())
    children.add(1, first)
    children.lock = lock = _TellsWhenWaitedOn()
    adding = threading.Thread(target=children.add, args=(2, second))
    held_off = []

    def rank_2_added_meanwhile(signum):  # while the signal thread kills rank 1
        adding.start()
        held_off.append(lock.waited_on.wait(timeout=5))  # it waits for the signal's end to be done

    first.send_signal.side_effect = rank_2_added_meanwhile
    errors = []
    signal_thread = threading.Thread(target=lambda: errors.append(children.stop(signal.SIGTERM, 30)))
    signal_thread.start()
    signal_thread.join(timeout=5)
    adding.join(timeout=5)
    assert errors == [None], "the signal's end of the children raised (dictionary changed size?)"
    assert held_off == [True], "rank 2 was added while the signal's end went through the children"
    second.kill.assert_called_with()  # the rank started as the signal came is ended too
    assert children.stopped_by == signal.SIGTERM


# --------------------------------------------------------------------------- long sweeps


NCCL_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT")


@pytest.mark.parametrize(
    "users, rank0",
    [
        ({}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}, {}),
        ({"NCCL_ASYNC_ERROR_HANDLING": "3"}, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}),  # the legacy name
    ],
)
def test_rank0_nccl_keeps_the_sweep_process_unless_the_user_said_otherwise(
    tmp_path, monkeypatch, users, rank0
):
    for key in NCCL_ENV:
        monkeypatch.delenv(key, raising=False)
    seen = {}

    def stage(job, *args):
        seen.update({key: os.environ.get(key) for key in NCCL_ENV})
        raise _StopAfterSpawn

    with mock.patch.object(hydra_fsdp._Job, "begin_stage", autospec=True, side_effect=stage):
        run = launch_with_mocked_children(tmp_path, HydraDDP, devices=3, env=users)
    assert isinstance(run.error, _StopAfterSpawn)
    assert seen == {key: None for key in NCCL_ENV} | users | rank0
    assert not any(key in os.environ for key in NCCL_ENV), "put back as it was after the job"
    for call in run.start.call_args_list:  # the children keep torch's defaults, or the user's values
        assert {key: call.args[1].get(key) for key in NCCL_ENV} == {key: None for key in NCCL_ENV} | users


def test_rank0s_nccl_error_handling_is_the_mode_torch_documents_as_abort_and_keep_the_process():
    """Which TORCH_NCCL_ASYNC_ERROR_HANDLING value aborts NCCL's communicators and keeps the process, as the
    header torch ships (include/, in every wheel) documents its ErrorHandlingMode: CleanUpOnly."""
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if not header.is_file():
        pytest.skip(f"this torch ships no {header.name}")
    text = " ".join(line.strip(" /") for line in header.read_text().splitlines())
    assert (
        "CleanUpOnly: just clean up collectives and abort communicators without tearing down process" in text
    )
    modes = dict(re.findall(r"\b(NoHandling|TearDown|CleanUpOnly|SkipCleanUp) = (\d)", text))
    assert modes == {"NoHandling": "0", "TearDown": "1", "CleanUpOnly": "2", "SkipCleanUp": "3"}
    assert hydra_fsdp._NCCL_KEEPS_THE_PROCESS["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == modes["CleanUpOnly"]


def test_the_abort_is_the_one_this_torch_has(monkeypatch):
    """ProcessGroup.abort of every group from torch 2.7; before, the default group's NCCL backend's abort
    (2.6) or _shutdown (2.3-2.5, where it aborts); gloo's backend has neither (and needs none)."""
    world, hybrid_shard = mock.Mock(spec=["abort"]), mock.Mock(spec=["abort"])
    registry = SimpleNamespace(default_pg=world, pg_map={world: None, hybrid_shard: None}, group_count=2)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_world", registry)
    hydra_fsdp._abort_groups()
    world.abort.assert_called_once_with()
    hybrid_shard.abort.assert_called_once_with()
    nccl_2_6, nccl_2_3, gloo = mock.Mock(spec=["abort", "_shutdown"]), mock.Mock(spec=["_shutdown"]), object()
    backends = {"cuda": nccl_2_6, "cpu": gloo, "meta": nccl_2_3}
    registry.default_pg = SimpleNamespace(_device_types=list(backends), _get_backend=backends.get)
    hydra_fsdp._abort_groups()
    nccl_2_6.abort.assert_called_once_with()
    nccl_2_6._shutdown.assert_not_called()
    nccl_2_3._shutdown.assert_called_once_with()


def test_rank0_cuda_unusable_after_an_abort_stops_the_sweep_saying_why(tmp_path, monkeypatch):
    def aborted(job, *args):
        job.abort.aborted = True
        raise _StopAfterSpawn

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    with mock.patch.object(hydra_fsdp._Job, "begin_stage", autospec=True, side_effect=aborted):
        run = launch_with_mocked_children(tmp_path, HydraDDP, devices=2)
    assert isinstance(run.error, SystemExit), "Hydra's callbacks warn of an Exception, and the sweep goes on"
    assert "rank 0's CUDA is unusable after this job failed" in str(run.error.code)
    assert "illegal memory access" in str(run.error.code) and "start the process again" in str(run.error.code)
    assert hydra_fsdp._sweep.job is None and not torch.distributed.is_initialized()


def test_ranks_whose_parameters_differ_in_dtype_alone_are_told_which_dtypes(monkeypatch):
    """Rank 0 (the sweep's process) keeps an earlier job's torch.set_default_dtype, a fresh child rank does
    not: the same module, float64 on rank 0 and float32 on rank 1. The check names the dtypes."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    trainer.state.fn = pl.trainer.states.TrainerFn.FITTING

    def strategy_with(dtype):
        module = FitModule().to(dtype)
        module.trainer = trainer
        return SimpleNamespace(
            num_nodes=1, num_processes=2, world_size=2, _lightning=pl, lightning_module=module,
            _holds_full_parameters=lambda: True, _stage_ckpt_path=None,
        )  # fmt: skip

    ranks = [strategy_with(torch.float64), strategy_with(torch.float32)]
    described = [hydra_fsdp._flat(hydra_fsdp._what_this_rank_runs(rank)) for rank in ranks]
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda everyone, mine: everyone.__setitem__(
        slice(None), described))  # fmt: skip
    with pytest.raises(RankLaunchError) as raised:
        hydra_fsdp._check_ranks_agree(ranks[1])
    differences = str(raised.value).split("disagree on it:\n")[1].split("\nBuild the same")[0]
    assert differences.startswith("  module parameters: rank 0 '2 float64 tensors of 3 values, shapes #")
    assert ", rank 1 '2 float32 tensors of 3 values, shapes #" in differences
    assert "\n" not in differences, "the dtype is the only difference"


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_full_model_parallel_checkpoint_is_read_once_to_the_cpu(tmp_path, monkeypatch, momentum):
    """HydraModelParallel leaves a full checkpoint to Lightning's one read, to the CPU (without map_location a
    tensor saved from CUDA lands on the saving rank's GPU), and loads the optimizers' states from it: one
    without per-parameter state (SGD, no momentum) as torch does, where Lightning's load fails on it."""
    try:
        strategy = hydra_fsdp.HydraModelParallel()
    except ImportError:
        pytest.skip("no HydraModelParallel on these releases (tested: it refuses to be built)")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    torch.save(
        {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, tmp_path / "f"
    )
    reads, lightning_saw, real_load = [], [], torch.load
    monkeypatch.setattr(
        torch, "load", lambda *args, **kwargs: reads.append(kwargs) or real_load(*args, **kwargs)
    )

    # Lightning's read of a full checkpoint (its load of the module needs a device mesh)
    def lightnings(self, path, weights_only=None):
        lightning_saw.append(list(self.optimizers))
        return {
            **torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only),
            "state_dict": None,
        }

    monkeypatch.setattr(pl.strategies.ModelParallelStrategy, "load_checkpoint", lightnings)
    resharded = mock.Mock()
    monkeypatch.setattr("torch.distributed.checkpoint.state_dict.set_optimizer_state_dict", resharded)
    strategy.model, strategy.optimizers = (
        model,
        [torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)],
    )
    checkpoint = strategy.load_checkpoint(tmp_path / "f")
    assert [read.get("map_location") for read in reads] == ["cpu"], "read once, to the CPU"
    assert (
        lightning_saw == [[]] and checkpoint["optimizer_states"][0]["param_groups"][0]["momentum"] == momentum
    )
    if momentum:  # resharded as Lightning does, keyed by name
        assert resharded.call_args.kwargs["optim_state_dict"]["state"].keys() == {"weight", "bias"}
    else:
        resharded.assert_not_called()
        assert strategy.optimizers[0].state_dict() == optimizer.state_dict()


@needs_fsdp_on_cpu
@pytest.mark.parametrize("device, offloaded", [("cuda", True), ("cpu", False)])
def test_a_sharded_checkpoint_gathers_a_module_in_the_hyperparameters_to_the_cpu(
    monkeypatch, device, offloaded
):
    """HydraFSDP pickles an nn.Module of the hyperparameters with its parameters gathered on rank 0: from
    GPUs to the CPU (onto rank 0's GPU the whole model may not fit), on the CPU in place (offloading
    there is what crashed Lightning's full state dict, see _full_state_gathered_in_place)."""
    strategy = HydraFSDP(state_dict_type="sharded")
    monkeypatch.setattr(type(strategy), "root_device", torch.device(device))
    summoned, saved = [], []
    summon = lambda module, **kwargs: summoned.append(kwargs) or contextlib.nullcontext()
    fsdp = SimpleNamespace(summon_full_params=summon)
    monkeypatch.setattr(hydra_fsdp, "_fsdp", lambda: SimpleNamespace(FullyShardedDataParallel=fsdp))
    monkeypatch.setattr(pl.strategies.FSDPStrategy, "save_checkpoint", lambda self, *args: saved.append(args))
    strategy.model = torch.nn.Linear(2, 1)
    strategy.save_checkpoint({"hyper_parameters": {"net": torch.nn.Linear(2, 1)}}, "path")
    assert summoned == [{"writeback": False, "rank0_only": True, "offload_to_cpu": offloaded}] and saved


def test_guard_fsdp_flat_param(monkeypatch):
    unit = SimpleNamespace(_fsdp_handles=[])  # FSDP keeps its handle under another name now
    fsdp = hydra_fsdp._fsdp().FullyShardedDataParallel
    monkeypatch.setattr(fsdp, "fsdp_modules", staticmethod(lambda module: [unit]))
    with pytest.raises(RankLaunchError, match=r"FlatParamHandle\.flat_param.*" + UPSTREAM_CHANGED):
        hydra_fsdp._free_flat_parameters(torch.nn.Linear(1, 1))


def test_guard_torch_abort_process_group(monkeypatch):
    world = SimpleNamespace(default_pg=mock.Mock(spec=["abort"]), group_count=0)  # torch >= 2.7
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_world", world)
    monkeypatch.delattr(torch.distributed.distributed_c10d, "_abort_process_group", raising=False)
    with pytest.raises(RankLaunchError, match=r"_abort_process_group.*" + UPSTREAM_CHANGED):
        hydra_fsdp._destroy_process_group(aborted=True)


def test_a_job_end_scans_only_the_jobs_objects_and_leaves_a_users_freeze_alone():
    import gc

    follower = hydra_fsdp._Sweep()
    # Python 3.12 keeps objects of its own frozen (375 on 3.12.1, back after any unfreeze and
    # collection), which no count tells from a user's freeze: there only the second half holds, and
    # a job's end scans everything (docs/benchmarks.md).
    if gc.get_freeze_count() == 0:
        follower.on_job_start(config=None)
        assert gc.get_freeze_count() > 0, "what the job found alive is frozen while it runs"
        follower.on_job_end(config=None, job_return=object())
        assert gc.get_freeze_count() == 0
    gc.freeze()  # the user's own (before forking DataLoader workers, say)
    try:
        frozen = gc.get_freeze_count()
        follower.on_job_start(config=None)
        follower.on_job_end(config=None, job_return=object())
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def inner():
    raise ValueError("inner")


def outer():  # a failed job's error: raised from another, each with a frame of its own
    try:
        inner()
    except ValueError as error:
        raise RuntimeError("outer") from error


def test_a_failed_jobs_frames_are_shown_once_with_their_errors_when_they_are_let_go_of(capsys):
    """A failed job's frames are let go of at its end (they hold its module). What a user then sees, at
    the job's end and when Hydra prints the error at the sweep's end, shows each frame once and next to
    its error: in notes under the errors, or on Python 3.10, which has none, the whole chain at once."""
    import traceback

    try:
        outer()
    except RuntimeError as error:
        failed = error
    hydra_fsdp._let_go_of_the_job(
        SimpleNamespace(status=hydra_fsdp.JobStatus.FAILED, _return_value=failed), []
    )
    assert failed.__traceback__ is None and failed.__cause__.__traceback__ is None
    at_the_jobs_end = capsys.readouterr().err
    at_the_sweeps_end = "".join(traceback.format_exception(type(failed), failed, None))
    shown = at_the_jobs_end + at_the_sweeps_end
    raising = ['raise ValueError("inner")', 'raise RuntimeError("outer") from error']  # the frames' lines
    assert [shown.count(line) for line in raising] == [1, 1], shown
    together = at_the_jobs_end if sys.version_info < (3, 11) else at_the_sweeps_end
    for text in (raising[0], "ValueError: inner", "direct cause", raising[1], "RuntimeError: outer"):
        assert text in together, f"{text!r} is not shown with the rest of the error:\n{shown}"


def test_a_failed_jobs_frames_are_shown_once_by_the_hydra_installed(capsys):
    """As the previous test, through Hydra's own JobReturn as run_job fills it: hydra-core 1.4 keeps each
    failed job's traceback as text and prints it with the error raised at the sweep's end; hydra_fsdp's
    notes would show each frame twice there."""
    import traceback

    from hydra.core import utils

    job_return = utils.JobReturn(status=utils.JobStatus.FAILED, overrides=[])
    try:
        outer()
    except RuntimeError as error:
        job_return.return_value = error
        if hasattr(utils, "_serialize_exception_chain"):  # hydra-core 1.4, as its _run_job does
            job_return._remote_traceback = utils._serialize_traceback(error.__traceback__)
            job_return._remote_exception_chain = utils._serialize_exception_chain(error)
    hydra_fsdp._let_go_of_the_job(job_return, [])
    with pytest.raises(RuntimeError, match="outer") as raised:
        job_return.return_value  # noqa: B018 - what Hydra's sweeper reads at the sweep's end
    # Python 3.10 with hydra-core 1.3: no notes, the chain was printed at the job's end
    shown = capsys.readouterr().err + "".join(traceback.format_exception(raised.value))
    raising = ['raise ValueError("inner")', 'raise RuntimeError("outer") from error']
    assert [shown.count(line) for line in raising] == [1, 1], shown


def test_a_failed_jobs_errors_all_let_go_of_their_frames_cause_and_context_alike():
    """An error raised ``from`` one error while handling another links to both: each one's frames hold the
    job's objects (D9: only ``__cause__ or __context__`` was followed, the context kept its frames)."""

    def failing():
        try:
            raise KeyError("handled")
        except KeyError:
            raise RuntimeError("raised") from ValueError("cause")

    try:
        failing()
    except RuntimeError as error:
        failed = error
    assert failed.__context__.__traceback__ is not None
    hydra_fsdp._let_go_of_the_job(
        SimpleNamespace(status=hydra_fsdp.JobStatus.FAILED, _return_value=failed), []
    )
    assert [failed.__traceback__, failed.__cause__.__traceback__, failed.__context__.__traceback__] == [
        None
    ] * 3


def test_a_job_end_that_raises_still_lets_go_of_the_job(monkeypatch):
    """Hydra makes an exception from a callback's on_job_end a warning and goes on to the next job: what the
    job held must be let go of all the same (D9: it was not, the job's memory stayed for the sweep)."""
    follower, job_return = hydra_fsdp._Sweep(), object()
    follower.ran = job_return
    follower.job = SimpleNamespace(job_return=job_return, finish=mock.Mock(side_effect=OSError("disk full")))
    let_go = mock.Mock()
    monkeypatch.setattr(hydra_fsdp, "_let_go_of_the_job", let_go)
    with pytest.raises(OSError, match="disk full"):
        follower.on_job_end(config=None, job_return=job_return)
    let_go.assert_called_once_with(job_return, follower.wrapped)


def test_a_finished_jobs_groups_are_destroyed_after_its_stage_ended(monkeypatch):
    """Fabric's stage lasts from launch() to the job's close: a child failing late, while the job's end
    destroys the group, must not start an abort of the same communicators on the fork server's reader
    thread (D6: the destroy ran with the stage still open)."""
    job = object.__new__(hydra_fsdp._Job)
    job.abort, job.released, job.runs_task = hydra_fsdp._StageAbort(store_port=0), True, True
    job.spec = SimpleNamespace(rank_timeout=1.0)
    job.children = SimpleNamespace(wait_until_exited=lambda timeout: None)
    job.close = mock.Mock()
    job.abort.in_stage = True  # entered at Fabric's launch(), left at the job's close
    in_stage_at_destroy = []
    monkeypatch.setattr(
        hydra_fsdp, "_destroy_process_group", lambda: in_stage_at_destroy.append(job.abort.in_stage)
    )
    job.finish(SimpleNamespace(status=hydra_fsdp.JobStatus.COMPLETED))
    assert in_stage_at_destroy == [False]
    job.abort.abort(for_rank=1)  # the late failure: nothing to abort any more
    assert not job.abort.aborted and job.abort.for_rank is None


def test_hanging_up_on_the_job_store_ends_a_wait_in_it_at_once():
    """D4: rank 0 waits in torch's C++ store, in init_process_group, for a child that died; hanging up on
    the job's store (its port) ends that wait at once, not after the store's timeout (a minute here, 30 by
    default in init_process_group). Other connections of the process are left alone, still blocking where
    a default timeout is set (a socket object made of a descriptor would make it non-blocking)."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    other = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    listener = socket.create_server(("127.0.0.1", 0))
    users = socket.create_connection(listener.getsockname())
    waiting = torch.distributed.TCPStore(
        "127.0.0.1", server.port, is_master=False, timeout=timedelta(minutes=1)
    )
    failed = []

    def wait_for_a_dead_child():
        try:
            waiting.get("rank_1")
        except RuntimeError as error:  # torch's DistNetworkError
            failed.append(error)

    waiter = threading.Thread(target=wait_for_a_dead_child, daemon=True)
    waiter.start()
    time.sleep(0.5)  # inside the C++ wait by now
    started = time.monotonic()
    socket.setdefaulttimeout(5)  # as a library may have set it
    try:
        hydra_fsdp._hang_up_on({server.port})
    finally:
        socket.setdefaulttimeout(None)
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "the wait in the store outlived the hang-up"
    assert failed and time.monotonic() - started < 10, failed
    other.set("still", "there")
    assert other.get("still") == b"there"
    assert not fcntl.fcntl(users.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
    users.close()
    listener.close()


def test_an_abort_ends_the_nccl_communicators_as_one_group(monkeypatch):
    """NCCL communicators aborted one by one can wait on each other (pytorch#119797): torch's own
    _abort_process_group aborts them between _group_start and _group_end, and so must _abort_groups (D8)."""
    calls = mock.Mock()
    nccl = SimpleNamespace(_group_start=calls.group_start, _group_end=calls.group_end)
    world = mock.Mock(spec=["abort"], abort=calls.abort_world)  # groups are the registry's keys: hashable
    registry = SimpleNamespace(pg_map={world: None, mock.Mock(spec=["abort"], abort=calls.abort_mesh): None})
    monkeypatch.setattr(torch.distributed, "group", SimpleNamespace(WORLD=world))
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_world", registry)
    monkeypatch.setattr(hydra_fsdp, "_backends_of", lambda group: [nccl])
    hydra_fsdp._abort_groups()
    assert [call[0] for call in calls.mock_calls] == ["group_start", "abort_world", "abort_mesh", "group_end"]


def test_the_exit_hook_ends_a_running_job_before_it_destroys_the_groups(monkeypatch):
    """SIGTERM or Ctrl-C mid-stage: the exit hook registered last runs first; it must end the running job
    (whose close knows its groups were aborted) before a plain destroy, which waits on an aborted NCCL
    group (D5: it destroyed first)."""
    calls = mock.Mock()
    monkeypatch.setattr(hydra_fsdp._sweep, "job", SimpleNamespace(close=calls.close_job))
    monkeypatch.setattr(hydra_fsdp._sweep, "fork_server", SimpleNamespace(close=calls.close_server))
    monkeypatch.setattr(hydra_fsdp, "_destroy_process_group", calls.destroy)
    monkeypatch.setattr(hydra_fsdp.gc, "freeze", lambda: None)
    hydra_fsdp._at_exit()  # the one exit hook: the job, then the groups, then the children's server
    assert [call[0] for call in calls.mock_calls] == ["close_job", "destroy", "close_server"]


def test_a_failed_childs_log_excerpt_reads_the_logs_end_only(tmp_path):
    import tracemalloc

    log = tmp_path / "rank_1.log"
    with open(log, "w") as out:
        out.write(("x" * 99 + "\n") * 640_000)  # 64 MB of a chatty rank
        out.write("".join(f"line {n}\n" for n in range(30)))
    tracemalloc.start()
    try:
        excerpt = hydra_fsdp._log_excerpt(log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert excerpt == [f"line {n}" for n in range(10, 30)]
    assert peak < 4 * 2**20, f"{peak / 2**20:.0f} MB held to show 20 lines of a 64 MB log"
    assert hydra_fsdp._log_excerpt(tmp_path / "never_written.log") == []


def test_at_exit_the_groups_end_and_the_rest_is_frozen_for_the_interpreters_own_collections():
    import gc

    with mock.patch.object(hydra_fsdp, "_destroy_process_group") as destroy:
        try:
            hydra_fsdp._at_exit()
            assert gc.get_freeze_count() > 0, "the exit's collections would scan it all again"
        finally:
            gc.unfreeze()
    destroy.assert_called_once_with()


def test_a_config_class_no_child_can_import_is_named_at_once():
    @dataclasses.dataclass
    class Local:  # defined in a function: no import finds it
        lr: float = 0.1

    pickled, why_not, _ = hydra_fsdp._pickled(hydra_fsdp.OmegaConf.structured(Local), "the job's config")
    assert (
        pickled is None
        and "the job's config cannot be pickled by reference" in why_not
        and "Local" in why_not
    )


def test_a_dataclass_made_at_run_time_is_made_again_with_its_fields():
    config = hydra_fsdp.OmegaConf.structured(make_config(lr=0.1, net=builds(torch.nn.Linear, 2, 3)))
    pickled, why_not, _ = hydra_fsdp._pickled(config, "the job's config")
    assert why_not == ""
    again = pickle.loads(pickled)
    made = hydra_fsdp.OmegaConf.to_object(again)
    assert type(made).__qualname__ == "Config" and type(made).__module__ == "types"
    assert (
        made.lr == 0.1 and type(made.net).__qualname__ == "Builds_Linear" and list(made.net._args_) == [2, 3]
    )


# --------------------------------------------------------------------------- the devices a job holds

CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("claims", ["a folder", "off"])
def test_each_child_is_started_on_its_cores_and_threads_and_rank0_gets_its_own_back(tmp_path, claims):
    """Alone on the node (the basic launcher), a job holds every core: each of its 2 ranks runs its
    half, and as many threads; rank 0's affinity, threads and OMP_NUM_THREADS come back after the job.
    With claiming off the ranks are not pinned: the threads split the cores, as before."""
    threads, seen = torch.get_num_threads(), {}

    def stage(job, *args):
        seen.update(affinity=sorted(os.sched_getaffinity(0)), threads=torch.get_num_threads())
        seen["omp"] = os.environ.get("OMP_NUM_THREADS")
        raise _StopAfterSpawn

    env = {} if claims == "a folder" else {"HYDRA_FSDP_CLAIMS": "off"}
    with mock.patch.object(hydra_fsdp._Job, "begin_stage", autospec=True, side_effect=stage):
        run = launch_with_mocked_children(tmp_path, HydraDDP, devices=2, env=env)
    assert isinstance(run.error, _StopAfterSpawn)
    half = len(CORES) // 2
    (child_env,) = [call.args[1] for call in run.start.call_args_list]
    assert seen["threads"] == int(seen["omp"]) == int(child_env["OMP_NUM_THREADS"]) == max(1, half)
    if claims == "off" or half == 0:
        assert seen["affinity"] == CORES
    else:
        assert seen["affinity"] == CORES[:half] and child_env["HYDRA_FSDP_RANK_CORES"] == ",".join(
            map(str, CORES[half : 2 * half])
        )
    assert ("HYDRA_FSDP_RANK_CORES" in child_env) == (claims != "off" and half > 0)
    assert "HYDRA_FSDP_JOB_GPUS" not in child_env  # on the CPU
    assert sorted(os.sched_getaffinity(0)) == CORES and torch.get_num_threads() == threads
    assert "OMP_NUM_THREADS" not in os.environ


def cuda_spec(*indexes):
    devices = tuple(torch.device("cuda", index) for index in indexes)
    return hydra_fsdp._LaunchSpec(
        len(devices), devices, "127.0.0.1", "pytorch_lightning", 60.0, "module", "datamodule"
    )


def test_devices_n_on_cuda_becomes_gpus_no_other_running_job_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_FSDP_CLAIMS", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with contextlib.ExitStack() as first_job, contextlib.ExitStack() as later_jobs:
        first = hydra_fsdp._placement(cuda_spec(0, 1), first_job)
        second = hydra_fsdp._placement(cuda_spec(0, 1), later_jobs)
        assert (first.gpus, second.gpus) == ([0, 1], [2, 3])
        assert first.threads == max(1, len(CORES) // 4) and first.cores == [None, None]
        assert hydra_fsdp._placement(cuda_spec(2, 3), later_jobs).gpus is None, "a list is used as given"
        with pytest.raises(RankLaunchError, match="asks for 5 gpus, and hydra_fsdp's jobs may use 4"):
            hydra_fsdp._placement(cuda_spec(0, 1, 2, 3, 4), later_jobs)
        first_job.close()  # the first job ended
        assert hydra_fsdp._placement(cuda_spec(0, 1), later_jobs).gpus == [0, 1]


@pytest.mark.parametrize("raises_in", ["taking the locks", "writing the claim"])
def test_a_claim_that_raises_anywhere_lets_go_of_every_device(tmp_path, monkeypatch, raises_in):
    """A raise between taking a device's lock and the try that let go of it (while the locks were taken,
    or while the claim's files were written) kept those locks and their files: a joblib worker then held
    those devices until it exited."""
    if raises_in == "taking the locks":  # the third lock: two are taken
        taken = iter([hydra_fsdp._locked_now] * 2 + [mock.Mock(side_effect=RuntimeError("interrupted"))])
        monkeypatch.setattr(hydra_fsdp, "_locked_now", lambda fd: next(taken)(fd))
    else:
        monkeypatch.setattr(os, "pwrite", mock.Mock(side_effect=OSError(28, "No space left on device")))
    open_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises((RuntimeError, OSError)):
        hydra_fsdp._claim(tmp_path, "gpu", ["0", "1", "2", "3"], 2, contextlib.ExitStack())
    still_open = set(os.listdir("/proc/self/fd")) - open_before
    assert not still_open, f"the claim's files are still open (fds {sorted(still_open)})"
    for name in "0123":
        with open(tmp_path / f"gpu{name}.lock", "a") as device:
            fcntl.flock(device, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: the claim still holds it


def test_two_jobs_that_each_need_every_device_take_them_one_after_the_other(tmp_path, monkeypatch):
    """Two claimers on one claims folder, 2 devices, each needing both, each pausing after taking its first
    device's lock: one claims at a time (the queue's lock), so the second waits for the first to let go.
    Without the queue each takes one device and waits for the other's, forever (a deadlock): here the
    bounded join fails, and the test then lets go of the claimers' locks so that every thread ends."""
    monkeypatch.setenv("HYDRA_FSDP_CLAIMS", str(tmp_path))
    folder, locked_now = hydra_fsdp._claims_folder(), hydra_fsdp._locked_now
    taken, start, claimed = {}, threading.Barrier(2), []  # by thread, the fds of the devices it took

    def pausing(fd):  # a claimer's first device taken: the other claimer has time to take the second
        free = locked_now(fd)
        if free:
            taken.setdefault(threading.get_ident(), []).append(fd)
            time.sleep(1.0 if len(taken[threading.get_ident()]) == 1 else 0)
        return free

    monkeypatch.setattr(hydra_fsdp, "_locked_now", pausing)

    def job():
        start.wait(timeout=10)
        with contextlib.ExitStack() as holds:
            claimed.append(hydra_fsdp._claim(folder, "gpu", ["0", "1"], 2, holds))
            time.sleep(0.3)  # the job runs on them, then lets go

    claimers = [threading.Thread(target=job, daemon=True) for _ in range(2)]
    for claimer in claimers:
        claimer.start()
    deadline = time.monotonic() + 15  # both within about 1.5 s, one after the other
    for claimer in claimers:
        claimer.join(timeout=max(0, deadline - time.monotonic()))
    waiting = sum(claimer.is_alive() for claimer in claimers)
    if waiting:  # each holds one device's lock: let go of them, each waiter then takes the other's
        for fd in [fd for fds in taken.values() for fd in fds]:
            fcntl.flock(fd, fcntl.LOCK_UN)
        for claimer in claimers:
            claimer.join(timeout=15)
    assert not waiting, f"{waiting} claims still waiting after 15 s: each holds a device the other needs"
    assert claimed == [[0, 1], [0, 1]]


def test_a_claims_folder_in_place_of_which_is_a_symlink_is_refused(tmp_path, monkeypatch):
    """Another user may make /tmp/hydra_fsdp-<uid> first, a symlink to a folder of the victim's (which then
    passes the owner and mode check) or to where they want files made: the folder is opened without
    following it, and a symlink there is refused, naming it and where it points."""
    mine, link = tmp_path / "mine", tmp_path / "claims"
    mine.mkdir(mode=0o700)
    for target in (mine, tmp_path / "nothing"):  # a folder of the user's own; nothing there yet
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        monkeypatch.setenv("HYDRA_FSDP_CLAIMS", str(link))
        where = rf"in {re.escape(str(link))}, which is a symlink to {re.escape(str(target))};"
        with pytest.raises(RankLaunchError, match=where + " expected a folder of your own"):
            hydra_fsdp._claims_folder()
        assert not list(mine.iterdir()) and not (tmp_path / "nothing").exists()
    link.unlink()
    link.write_text("")
    with pytest.raises(RankLaunchError, match=rf"in {re.escape(str(link))}, which is owner uid .*; expected"):
        hydra_fsdp._claims_folder()


def test_the_launch_file_is_its_owners_alone_from_its_creation(tmp_path, monkeypatch):
    """A pickle a rank loads (the launch file; rank 0's result) is readable and writable by its owner only,
    whatever the umask, from the file's creation (never a chmod after): made 0o600 under a name of its own
    and renamed over the path once whole, a file of another mode there replaced."""
    write_private, replace, before, written = hydra_fsdp._write_private, os.replace, [], {}

    def replacing(temp, path):  # the file as it is before anyone finds it at the path
        before.append((os.stat(temp).st_mode & 0o777, Path(temp).read_bytes()))
        replace(temp, path)

    def writing(path, data):
        write_private(path, data)
        written[path] = path.stat().st_mode & 0o777

    monkeypatch.setattr(hydra_fsdp, "_write_private", writing)
    umask = os.umask(0)
    try:
        (tmp_path / "result").write_bytes(b"an older job's")
        (tmp_path / "result").chmod(0o666)
        with monkeypatch.context() as scoped:
            scoped.setattr(os, "replace", replacing)
            write_private(tmp_path / "result", b"this job's")
        run = launch_with_mocked_children(tmp_path, HydraDDP, devices=2)
    finally:
        os.umask(umask)
    assert before == [(0o600, b"this job's")] and (tmp_path / "result").read_bytes() == b"this job's"
    assert (tmp_path / "result").stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".result*")), "the file written under another name is left"
    assert isinstance(run.error, _StopAfterSpawn) and run.launch is not None
    assert written == {run.job_dir / "rank_config.pickle": 0o600}


def test_the_gpus_a_sweep_may_claim_and_their_names_across_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_FSDP_CLAIMS", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("HYDRA_FSDP_GPUS", "1,3")
    with contextlib.ExitStack() as job:
        assert hydra_fsdp._placement(cuda_spec(0, 1), job).gpus == [1, 3]
        assert sorted(path.name for path in tmp_path.glob("*.lock")) == ["gpu5.lock", "gpu7.lock"]
        assert (tmp_path / "gpu5.lock").read_text() == f"{os.getpid()}\n"  # for a waiter to name
    for wrong in ("1,4", "-1,0", "a,b"):
        monkeypatch.setenv("HYDRA_FSDP_GPUS", wrong)
        with pytest.raises(RankLaunchError, match=rf"HYDRA_FSDP_GPUS='{wrong}': .* below the 4 torch sees"):
            hydra_fsdp._placement(cuda_spec(0, 1), contextlib.ExitStack())


def test_every_rank_of_a_job_runs_on_the_gpus_it_holds():
    strategy = HydraDDP(accelerator="cpu")
    strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert strategy.root_device == torch.device("cuda", 0)  # Lightning's, for devices=2
    strategy._job_gpus = [5, 7]
    assert strategy.root_device == torch.device("cuda", 5)
    with mock.patch.object(type(strategy), "local_rank", new_callable=mock.PropertyMock, return_value=1):
        assert strategy.root_device == torch.device("cuda", 7)


def test_a_worker_that_cannot_find_the_scripts_function_says_which(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__file__=str(tmp_path / "train.py")))
    with pytest.raises(RankLaunchError, match=r"cannot find main \(line 12\) in .*train.py"):
        hydra_fsdp._in_script(str(tmp_path / "train.py"), "main", 12)


@pytest.mark.parametrize(
    "launcher, share",
    [
        ({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, 16),  # one job at a time
        ({"n_jobs": 4}, 4),  # joblib: 4 jobs at once
        ({"n_jobs": 10}, 1),  # its default: at least one core a job
        ({"n_jobs": -1}, 16 // os.cpu_count() or 1),  # as many jobs as CPUs, as joblib reads -1
        ({"cpus_per_task": 3, "tasks_per_node": 1}, 3),  # submitit says it
    ],
)
def test_a_cpu_jobs_share_of_the_cores_is_what_its_launcher_runs_at_once(monkeypatch, launcher, share):
    config = hydra_fsdp.OmegaConf.create({"launcher": launcher})
    monkeypatch.setattr(hydra_fsdp, "HydraConfig", SimpleNamespace(get=lambda: config))
    assert hydra_fsdp._cores_per_job(16) == max(1, share)


@pytest.mark.parametrize("accelerator", ["cpu", "auto"])
def test_a_launcher_jobs_accelerator_is_its_own_not_the_nodes(tmp_path, monkeypatch, accelerator):
    """hydra/launcher=hydra_fsdp: a 2-rank job with trainer.accelerator=cpu on a node with 1 GPU claims
    cores (it failed "asks for 2 gpus": the node decided); on auto, the GPU, which it cannot have 2 of."""
    monkeypatch.setenv("HYDRA_FSDP_CLAIMS", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = OmegaConf.create({"launcher": {"n_jobs": 1}})
    monkeypatch.setattr(hydra_fsdp, "HydraConfig", SimpleNamespace(get=lambda: config))
    settings = OmegaConf.create({"nproc_per_node": 2, "accelerator": accelerator, "rank_timeout": 60})
    spec, inventory = hydra_fsdp._job_spec(settings)
    with contextlib.ExitStack() as job:
        if accelerator == "auto":
            with pytest.raises(RankLaunchError, match="asks for 2 gpus"):
                hydra_fsdp._placement(spec, job)
            return
        placement = hydra_fsdp._placement(spec, job)
    assert inventory == {} and [device.type for device in spec.devices] == ["cpu", "cpu"]
    assert placement.gpus is None and all(cores for cores in placement.cores)


MOVED_TO_THE_CPU = []


class OnAGPU(torch.Tensor):
    """A tensor that says it is on a GPU (none here), as one rank 0 returns from cuda:0 would."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    def cpu(self):
        MOVED_TO_THE_CPU.append(self)
        return self.as_subclass(torch.Tensor)


def test_rank_0s_tensors_come_back_on_the_cpu_and_what_cannot_be_pickled_is_named(tmp_path, monkeypatch):
    """Unpickled as it was, a CUDA tensor would start CUDA in the job's agent and in the sweep's process, on
    cuda:0, a GPU another job may hold. The result file is written whole, its owner's alone."""
    result = tmp_path / "rank_0.result.pickle"
    monkeypatch.setenv("HYDRA_FSDP_RESULT", str(result))  # every rank has it: rank 0 alone writes it
    monkeypatch.setenv("RANK", "1")
    hydra_fsdp._hand_back(value="rank 1's")
    assert not result.exists()
    monkeypatch.setenv("RANK", "0")
    on_a_gpu = torch.arange(3.0).as_subclass(OnAGPU)
    hydra_fsdp._hand_back(value={"metric": on_a_gpu, "plain": torch.ones(1)})
    handed = pickle.loads(result.read_bytes())["value"]
    assert MOVED_TO_THE_CPU == [on_a_gpu] and type(handed["metric"]) is torch.Tensor
    assert handed["metric"].tolist() == [0.0, 1.0, 2.0] and handed["plain"].tolist() == [1.0]
    assert result.stat().st_mode & 0o777 == 0o600 and [p.name for p in tmp_path.iterdir()] == [result.name]
    hydra_fsdp._hand_back(value=threading.Lock())
    error = pickle.loads(result.read_bytes())["error"]
    assert "Rank 0's return value (a lock) cannot be pickled" in str(error)


# --------------------------------------------------------------------------- the fork server's own bounds


def stand_in_server(proc):
    """A _ForkServer around ``proc`` without a Hydra job, and the server's end of its connection: its
    reader and close are what is tested."""
    server = hydra_fsdp._ForkServer.__new__(hydra_fsdp._ForkServer)
    server.proc, server.imports = proc, []
    server.conn, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return server, theirs


def test_a_failed_childs_callback_that_blocks_or_raises_leaves_the_reader_reading(caplog):
    """A failed child's callback (its stage's abort: NCCL's can block) runs on a thread of its own: on the
    reader's, one that blocked would hold every later reply, and one that raised would end the reader,
    marking the live server lost (its running children read as killed, the next start unbounded)."""
    server, theirs = stand_in_server(None)
    released, later = threading.Event(), mock.Mock()
    blocking = mock.Mock(side_effect=lambda: released.wait(30))
    server.listen(threading.Condition())
    server.on_failure = {10: blocking, 11: mock.Mock(side_effect=RuntimeError("the abort failed")), 12: later}
    for pid in (10, 11, 12):
        theirs.send(json.dumps({"exited": pid, "code": 1}).encode())
    with server.said:
        server.said.wait_for(lambda: 12 in server.exit_codes or server.lost, timeout=5)
    assert 12 in server.exit_codes and not server.lost, "the reader waited on, or ended with, a callback"
    deadline = time.monotonic() + 5
    while not (later.called and "the abort failed" in caplog.text) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert later.called and "the abort failed" in caplog.text
    released.set()
    theirs.close()
    with server.said:  # its replies ended: now it is
        assert server.said.wait_for(lambda: server.lost, timeout=5)


def test_closing_a_server_stuck_on_a_child_is_bounded(monkeypatch):
    """The server reaps its children before it exits; one the kernel holds would hold the sweep's end."""
    monkeypatch.setattr(hydra_fsdp, "_KILL_WAIT", 0.5)
    stuck = "import time; time.sleep(60)"  # its connection closed, it still does not exit
    server, theirs = stand_in_server(subprocess.Popen([sys.executable, "-c", stuck]))
    started = time.monotonic()
    try:
        closing = threading.Thread(target=server.close, daemon=True)
        closing.start()
        closing.join(timeout=10)
        assert not closing.is_alive(), "close() still waits on the server"
        assert server.proc.poll() is not None and time.monotonic() - started < 5
    finally:
        theirs.close()
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="module")
def chatty_fork_server(tmp_path_factory):
    """A real fork server whose "Lightning" prints at import, as a banner or a notice on stdout would."""
    lightning = tmp_path_factory.mktemp("stand_in") / "chatty_lightning"
    lightning.mkdir(parents=True)
    (lightning / "__init__.py").write_text("print('a banner, printed at import')\n")
    hydra_config = SimpleNamespace(get=lambda: SimpleNamespace(job=SimpleNamespace(env_set={})))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(lightning.parent))
        patch.setattr(hydra_fsdp, "HydraConfig", hydra_config)
        importlib.import_module("chatty_lightning")  # the sweep's: what the server imports too
        server = hydra_fsdp._ForkServer("chatty_lightning", {}).listen(threading.Condition())
    yield server
    server.close()


class SleepsWhenLoaded:
    """A launch file of it keeps the child that loads it asleep, until it is killed."""

    def __reduce__(self):
        return time.sleep, (60,)


def start_a_sleeping_child(server, log, timeout=60):
    """``server.start``, run on a thread: None where it did not return within ``timeout`` + 30 s."""
    env = dict(os.environ, LOCAL_RANK="1")
    launch = log.with_name("sleeps.pickle")
    launch.write_bytes(pickle.dumps(SleepsWhenLoaded()))
    started = []
    starting = threading.Thread(
        target=lambda: started.append(server.start(["sleep", str(launch)], env, log, timeout, lambda: None)),
        daemon=True,
    )
    starting.start()
    starting.join(timeout + 30)
    return started[0] if started else None


def test_a_fork_server_whose_imports_print_still_starts_children(chatty_fork_server, tmp_path):
    """The server's replies were its stdout, which it redirected only after its imports: a line an import
    printed killed the reader (a JSON decode error), and start() then waited, without a bound, for the
    live server to exit."""
    child = start_a_sleeping_child(chatty_fork_server, tmp_path / "rank_1.log", timeout=30)
    assert child is not None, "start() is still waiting, on a server that runs, for a reply it lost"
    assert not chatty_fork_server.lost and child.poll() is None
    child.kill()
    assert child.wait(timeout=10) == -signal.SIGKILL


def test_a_pid_the_server_reaped_is_never_signalled(chatty_fork_server, tmp_path):
    """The server reaps a child before rank 0 hears that it exited: in that window rank 0 still sees it
    running, and its pid may already be another process's. Only the server, which reaps, may signal."""
    child = start_a_sleeping_child(chatty_fork_server, tmp_path / "rank_1.log")
    recycled = subprocess.Popen(["sleep", "60"])  # a process that got the pid of a child reaped since
    try:
        hydra_fsdp._ForkedChild(chatty_fork_server, recycled.pid).kill()  # rank 0 has not heard it exited
        child.kill()  # after the other, in order: once this one is reaped, the other request was read
        assert child.wait(timeout=10) == -signal.SIGKILL
        with contextlib.suppress(subprocess.TimeoutExpired):
            recycled.wait(timeout=1)
        assert recycled.poll() is None, (
            f"rank 0 sent SIGKILL to pid {recycled.pid}, not a child of the server"
        )
    finally:
        recycled.kill()
        recycled.wait()


@pytest.mark.parametrize("wrapped_by_the_user", [False, True])
def test_fsdp_on_the_cpu_hides_the_wrap_policy_from_lightning_only_where_it_applied_it(
    monkeypatch, wrapped_by_the_user
):
    """On the CPU HydraFSDP wraps the model itself with the policy, so Lightning must not see the policy
    (it would warn that it ignores it); a model the user wrapped keeps Lightning's warning, and the
    policy is there again for the next stage either way."""

    class FullyShardedDataParallel(torch.nn.Module):
        def __init__(self, module, **kwargs):
            super().__init__()
            self.module, self.kwargs = module, kwargs

    monkeypatch.setattr(
        hydra_fsdp, "_fsdp", lambda: SimpleNamespace(FullyShardedDataParallel=FullyShardedDataParallel)
    )
    monkeypatch.setattr(hydra_fsdp._sweep, "wrapped", [])
    strategy = SimpleNamespace(
        root_device=torch.device("cpu"), cpu_offload=None, mixed_precision_config=None, sharding_strategy=None
    )
    model = torch.nn.Linear(2, 1)
    model = FullyShardedDataParallel(model) if wrapped_by_the_user else model
    kwargs, seen = {"auto_wrap_policy": "policy"}, []
    result = hydra_fsdp._sharded(strategy, model, lambda m: seen.append(dict(kwargs)) or m, kwargs)
    assert isinstance(result, FullyShardedDataParallel) and hydra_fsdp._sweep.wrapped == [result]
    assert (result is model) == wrapped_by_the_user
    assert seen == [kwargs if wrapped_by_the_user else {}] and kwargs == {"auto_wrap_policy": "policy"}
