"""A Lightning Fabric training loop as a Hydra task function (hydra-zen), for tests/test_fabric.py.

``python app.py -m strategy=ddp,fsdp,model_parallel lr=0.1,0.2``: each job builds
``Fabric(accelerator="cpu", devices=2, strategy=hydra_fsdp.fabric.Hydra...)``, calls ``fabric.launch()``
(or, with ``launch_fn=true``, ``fabric.launch(train, ...)``) and trains a seeded model a few steps, each
rank on its own half of the batch. Every rank writes what it saw to ``<job dir>/seen/rank<r>.json``: its
config's values and types, output dir, cwd, world size, pid, the parameters it holds and the losses.
Each rank records as ``fabric.launch()`` returns what started it, in ``<job dir>/started/rank<r>.json``: its
pid, its parent's (the fork server, for a child) and its age then (seconds since its process started).
``fail_rank`` / ``fail_how`` make that rank fail in job ``fail_job``: at the third step (``raise``, ``kill``,
``hang``: it sleeps there, its peers blocked in their next collective), or before ``fabric.launch()``
(``init_hang``); ``step_seconds`` slows every step;
``bf16_on_rank_1=true`` has rank 1 build a Fabric of another precision; ``phase=save`` saves the model
and optimizer after training (``fabric.save``) to ``checkpoint``, where ``phase=load`` (a later job)
loads them before it trains on (``fabric.load``).
A failed job's error goes to ``<job dir>/error.txt`` (``RecordError``), and what the sweep's process holds
as a job starts to ``<job dir>/start.json`` (``RecordStart``: its process group, its parameters, and which
child ranks of the sweep's earlier jobs still run); both are Hydra callbacks, added with
``+hydra.callbacks.<name>._target_=__main__.<class>``.
"""

import datetime
import gc
import json
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra_zen import builds, just, make_config, store, zen
from lightning.fabric import Fabric

import hydra_fsdp

Strategies = hydra_fsdp.fabric  # on lightning.fabric, which this app imported


class Mode(Enum):
    FAST = 1
    CAREFUL = 2


@dataclass
class Data:
    samples: int = 32
    mode: Mode = Mode.CAREFUL


def fully_shard_each_layer(model, device_mesh):
    """HydraModelParallel's parallelize_fn: FSDP2 over the mesh's data-parallel dimension."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=device_mesh["data_parallel"])
    return fully_shard(model, mesh=device_mesh["data_parallel"])


def age():
    """Seconds since this process started (/proc: its start in clock ticks after boot)."""
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return float(Path("/proc/uptime").read_text().split()[0]) - started / os.sysconf("SC_CLK_TCK")


def write_json(path, value):
    """Write ``value`` to ``path`` whole: a reader sees it complete or not at all."""
    path.parent.mkdir(exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps(value))
    part.rename(path)


def train(fabric, lr, steps, step_seconds, data, fail_rank, fail_how, fail_job, phase, checkpoint):
    job = HydraConfig.get().job.num
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    started = {"pid": os.getpid(), "ppid": os.getppid(), "age": age()}
    write_json(job_dir / "started" / f"rank{fabric.global_rank}.json", started)
    torch.manual_seed(0)  # the same initial weights on every rank and in every job
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = fabric.setup_module(model)
    # momentum: an optimizer with state (Fabric cannot load a sharded SGD state without any)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(data.samples, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    mine = slice(fabric.global_rank, None, fabric.world_size)  # this rank's half of the batch
    if phase == "load":  # where the sweep's job that saved it stopped
        fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
    losses = []
    for step in range(steps):
        if step == 2 and job == fail_job and fabric.global_rank == fail_rank:
            if fail_how == "kill":
                os.kill(os.getpid(), 9)
            if fail_how == "hang":
                write_json(job_dir / "hanging" / f"rank{fail_rank}.json", {"step": step})
                time.sleep(3600)
            raise RuntimeError(f"rank {fail_rank} fails on purpose at step {step}")
        time.sleep(step_seconds)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach(), reduce_op="mean")))
    if phase == "save":
        fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    seen = {
        "rank": fabric.global_rank,
        "world": fabric.world_size,
        "pid": os.getpid(),
        "job": job,
        "lr": lr,
        "lr_type": type(lr).__name__,
        "data_type": type(data).__qualname__,
        "mode": type(data.mode).__qualname__ + "." + data.mode.name,
        "strategy": type(fabric.strategy).__module__ + "." + type(fabric.strategy).__qualname__,
        "output_dir": HydraConfig.get().runtime.output_dir,
        "cwd": os.getcwd(),
        "master_port": os.environ.get("MASTER_PORT"),  # where the process group met
        # its own shard: a DTensor's numel is the whole parameter's
        "params_held": sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in model.parameters()),
        "losses": losses,
    }
    write_json(job_dir / "seen" / f"rank{fabric.global_rank}.json", seen)
    return losses[-1]


def task(
    fabric: Fabric,
    lr,
    steps,
    step_seconds,
    data,
    fail_rank,
    fail_how,
    fail_job,
    launch_fn,
    bf16_on_rank_1,
    phase,
    checkpoint,
):
    arguments = (lr, steps, step_seconds, data, fail_rank, fail_how, fail_job, phase, checkpoint)
    if (
        fail_how == "init_hang"
        and HydraConfig.get().job.num == fail_job
        and os.environ.get("LOCAL_RANK") == "1"
    ):
        time.sleep(3600)  # rank 1, before it reaches fabric.launch()
    if bf16_on_rank_1 and os.environ.get("LOCAL_RANK") == str(fail_rank):  # a Fabric that differs on one rank
        fabric = Fabric(accelerator="cpu", devices=2, strategy=Strategies.HydraDDP(), precision="bf16-mixed")
    if launch_fn:
        return fabric.launch(train, *arguments)
    fabric.launch()
    return train(fabric, *arguments)


class RecordStart(Callback):
    """What the sweep's process (rank 0) still holds as each job starts: a process group, parameters."""

    def on_job_start(self, config, **kwargs):
        gc.collect()
        held = [obj for obj in gc.get_objects() if isinstance(obj, torch.nn.Parameter)]
        job_dir = Path(HydraConfig.get().runtime.output_dir)
        earlier = [path for path in job_dir.parent.glob("*/started/rank*.json") if path.name != "rank0.json"]
        start = {
            "pid": os.getpid(),
            "process_group": torch.distributed.is_initialized(),
            "parameters": len(held),
            # every child rank of an earlier job: each was ended with its job, so none runs
            "children_alive": [str(path) for path in earlier if alive(json.loads(path.read_text())["pid"])],
        }
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / "start.json").write_text(json.dumps(start))


def alive(pid):
    """Whether ``pid`` runs: the fork server reaps a child as it exits, so an ended one is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class RecordError(Callback):
    """A failed job's error, as the sweep process holds it, in the job's dir (the sweep goes on)."""

    def on_job_end(self, config, job_return, **kwargs):
        error = getattr(job_return, "_return_value", None)
        if isinstance(error, BaseException):
            notes = "".join(f"\n{note}" for note in getattr(error, "__notes__", []))  # hydra_fsdp's, under it
            text = f"{type(error).__name__}: {error}\ncaused by: {error.__cause__!r}{notes}"
            Path(HydraConfig.get().runtime.output_dir, "error.txt").write_text(text)


strategy_store = store(group="strategy")
# what a job may set: hydra_fsdp's bound on a child's start, and the process group's timeout (torch's default)
TIMEOUTS = {"rank_timeout": 60, "timeout": builds(datetime.timedelta, seconds=1800)}
strategy_store(builds(Strategies.HydraDDP, **TIMEOUTS), name="ddp")
strategy_store(builds(Strategies.HydraFSDP, **TIMEOUTS), name="fsdp")  # Fabric's default: sharded checkpoints
strategy_store(builds(Strategies.HydraFSDP, state_dict_type="full", **TIMEOUTS), name="fsdp_full")
strategy_store(
    builds(
        Strategies.HydraModelParallel,
        just(fully_shard_each_layer),
        data_parallel_size=2,
        tensor_parallel_size=1,
        **TIMEOUTS,
    ),
    name="model_parallel",
)
store(
    make_config(
        hydra_defaults=["_self_", {"strategy": "ddp"}],
        fabric=builds(Fabric, accelerator="cpu", devices=2, strategy="${strategy}"),
        strategy=None,
        lr=0.1,
        steps=4,
        step_seconds=0.0,
        data=builds(Data, populate_full_signature=True),
        fail_rank=-1,
        fail_how="raise",
        fail_job=0,
        launch_fn=False,
        bf16_on_rank_1=False,
        phase="train",
        checkpoint="${hydra:sweep.dir}/checkpoint_${hydra:runtime.choices.strategy}",
    ),
    name="config",
)

if __name__ == "__main__":
    store.add_to_hydra_store()
    zen(task).hydra_main(config_name="config", config_path=None, version_base="1.3")
