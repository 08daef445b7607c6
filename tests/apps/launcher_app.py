"""The app tests/test_launcher.py sweeps under ``hydra/launcher=hydra_fsdp``: a plain @hydra.main app, as
torchrun would run it. Every rank writes what it saw to <job dir>/seen/rank<RANK>.json and rank 0 returns
it; ``case`` picks what a job does:

- ``plain``: train, with ``strategy``: "ddp" (Lightning's own), "hydra" (hydra_fsdp.HydraDDP), "hydra_fsdp"
  (HydraFSDP), "fabric" (Fabric's own ddp), "torch" (torch.distributed.init_process_group(), no Lightning),
  "deepspeed2" or "deepspeed3" (Lightning's DeepSpeedStrategy, ZeRO stage 2 or 3, on the CPU: CPUDeepSpeed);
- ``double``: train after ``torch.set_default_dtype(torch.float64)``;
- ``segfault``: rank 0 segfaults before training;
- ``collective``: rank 1 raises while rank 0 waits for it in an all_reduce;
- ``rendezvous``: rank 1 is killed (SIGKILL, as by the OOM killer) while rank 0 waits for it in
  ``init_process_group``, where no process group exists yet to abort;
- ``hang``: rank 1 sleeps while rank 0 waits for it in an all_reduce (for job_timeout, or a signal);
- ``meet``: one rank per job, waiting for the other job's (``meet_in``): jobs at once, no training
  (``accelerator=gpu``: on a GPU each);
- ``exit``: rank 0 exits (status 0) before it returns anything;
- ``unpicklable``: rank 0 returns a lock, which cannot be pickled;
- ``slow_build``: rank 0 builds for 3 s (a sleep) before it meets the other ranks in the process group;
- ``interrupted``: train for long (half a second a step, 100 epochs), each rank with a callback whose
  ``on_exception`` takes 1.5 s (as a logger's finalize does), then writes <job dir>/on_exception_rank<RANK>
  holding the exception's type; each rank writes training_rank<RANK> as it begins its first step. For a
  signal to the sweep mid-fit.

Every rank logs "rank <r> runs job <n>" (logger ``launcher_app``) as it starts. With
``LAUNCHER_APP_CLOSURE=1`` the task function is a closure, which a child cannot import by name; with
``LAUNCHER_APP_TOUCH_CUDA=1`` the script calls ``torch.cuda.is_available()`` as it is imported.

``+hydra.callbacks.record._target_=__main__.Record`` records, in the sweep's process, each job's end as
Hydra's callbacks see it, with that process's own state, in <sweep dir>/jobs.jsonl.
"""

import ctypes
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import pytorch_lightning as pl
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from lightning_fabric import Fabric

import hydra_fsdp

TASKS_RUN_HERE = 0  # in this process: the sweep's must stay at 0


@dataclass
class Config:
    case: str = "plain"
    strategy: str = "ddp"
    lr: float = 0.1
    devices: int = 2
    accelerator: str = "cpu"
    meet_in: str = ""
    together: bool = False  # hydra.launcher.start_ranks_together=${together}: read per job


class SlowOnException(pl.Callback):
    """``case=interrupted``'s callback (see the module's docstring)."""

    def on_train_batch_start(self, trainer, pl_module, batch, idx):
        (Path(HydraConfig.get().runtime.output_dir) / f"training_rank{trainer.global_rank}").touch()
        time.sleep(0.5)

    def on_exception(self, trainer, pl_module, exception):
        time.sleep(1.5)
        job_dir = Path(HydraConfig.get().runtime.output_dir)
        (job_dir / f"on_exception_rank{trainer.global_rank}").write_text(type(exception).__name__)


class Tiny(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Linear(4, 1)
        self.losses = []  # this rank's, step by step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0)).to(torch.get_default_dtype())
        return torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
        )


def cpu_deepspeed(stage, devices):
    """Lightning's DeepSpeedStrategy, ZeRO ``stage``, on the CPU (gloo), test-only: Lightning refuses a
    non-CUDA accelerator by type in setup_environment (DDP's is taken instead) and wants indexed devices.
    The engine, its optimizer and its communication are DeepSpeed's own."""
    import deepspeed.ops
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (deepspeed_shm_comm, with g++: 76 s to
    # 280 s on one core, then cached in ~/.cache/torch_extensions) as its first group starts, only for
    # inference_all_reduce (AutoTP's layers in inference mode), which ZeRO never calls. Marked incompatible
    # (DeepSpeed has no setting for it), it is not built, and every collective is torch's, gloo's.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    class CPUDeepSpeed(DeepSpeedStrategy):
        setup_environment = DDPStrategy.setup_environment

    strategy = CPUDeepSpeed(stage=stage, parallel_devices=[torch.device("cpu", i) for i in range(devices)])
    # ZeRO-3 keeps parameters under 100,000 values whole on every rank (DeepSpeed's default): partition all
    strategy.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return strategy


def meet(cfg, rank):
    """Wait, at most a minute, until the other job's rank is here too."""
    Path(cfg.meet_in, str(HydraConfig.get().job.num)).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(cfg.meet_in)) < 2:
        assert time.monotonic() < deadline, "the other job never ran at the same time as this one"
        time.sleep(0.05)


def train(cfg):
    """Train with the strategy ``cfg.strategy`` names: what this rank saw of it."""
    deepspeed = cfg.strategy.startswith("deepspeed")
    if deepspeed:  # the same weights on every rank, for every stage (ZeRO-2 and ZeRO-3 compared)
        torch.manual_seed(0)
    module = Tiny(cfg.lr)
    if cfg.strategy == "torch":
        torch.distributed.init_process_group("gloo")
        ranks = torch.ones(1)
        torch.distributed.all_reduce(ranks)
        world, rank, strategy, device = int(ranks), torch.distributed.get_rank(), "init_process_group", "cpu"
        torch.distributed.destroy_process_group()
    elif cfg.strategy == "fabric":
        fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, strategy="ddp")
        fabric.launch()
        model, optimizer = fabric.setup(module, module.configure_optimizers())
        for x, y in fabric.setup_dataloaders(module.train_dataloader()):
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        world, rank, strategy, device = fabric.world_size, fabric.global_rank, "Fabric", str(fabric.device)
    else:
        strategies = {"hydra": hydra_fsdp.HydraDDP, "hydra_fsdp": hydra_fsdp.HydraFSDP}
        if deepspeed:
            strategy = cpu_deepspeed(int(cfg.strategy[-1]), cfg.devices)
        else:
            strategy = strategies[cfg.strategy]() if cfg.strategy in strategies else cfg.strategy
        trainer = pl.Trainer(
            accelerator=cfg.accelerator,
            devices=cfg.devices,
            strategy=strategy,
            max_epochs=3 if deepspeed else 100 if cfg.case == "interrupted" else 1,
            callbacks=[SlowOnException()] if cfg.case == "interrupted" else None,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        if cfg.case != "meet":
            trainer.fit(module)
        world, rank, strategy = trainer.world_size, trainer.global_rank, type(trainer.strategy).__name__
        device = str(trainer.strategy.root_device)
    param_dtype = str(next(module.parameters()).dtype)
    seen = {
        "world": world,
        "global_rank": rank,
        "strategy": strategy,
        "root_device": device,
        "param_dtype": param_dtype,
        "losses": module.losses,
    }
    if deepspeed:
        engine = trainer.strategy.deepspeed_engine
        seen.update(
            engine=type(engine).__name__,
            optimizer=type(engine.optimizer).__name__,
            zero_stage=engine.zero_optimization_stage(),
            # what this rank holds of the weights outside a forward: all of them (ZeRO-2), none (ZeRO-3:
            # its shard of each parameter is the parameter's ds_tensor)
            local_numel=sum(p.numel() for p in module.parameters()),
            shard_numel=sum(p.ds_tensor.numel() for p in module.parameters() if hasattr(p, "ds_tensor")),
        )
    return seen


def task(cfg):
    global TASKS_RUN_HERE
    TASKS_RUN_HERE += 1
    rank = int(os.environ["RANK"])
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    started_at = time.time()
    logging.getLogger("launcher_app").info(f"rank {rank} runs job {HydraConfig.get().job.num}")
    if cfg.case == "exit" and rank == 0:
        os._exit(0)
    if cfg.case == "unpicklable" and rank == 0:
        return threading.Lock()
    if cfg.case == "slow_build":
        time.sleep(3 if rank == 0 else 0)
        (job_dir / f"meets_rank{rank}").write_text(str(time.time()))
        torch.distributed.init_process_group("gloo")
        torch.distributed.destroy_process_group()
    if cfg.case == "segfault" and rank == 0:
        ctypes.string_at(0)
    if cfg.case == "double":
        torch.set_default_dtype(torch.float64)
    if cfg.case in ("collective", "hang"):
        torch.distributed.init_process_group("gloo")
        (job_dir / f"in_collective_rank{rank}").write_text(str(os.getpid()))
        if rank == 1:
            time.sleep(1 if cfg.case == "collective" else 10_000)
            raise ValueError("injected on rank 1")
        torch.distributed.all_reduce(torch.ones(1))  # waits for rank 1
    if cfg.case == "rendezvous":
        if rank == 1:
            time.sleep(1)  # rank 0 is in init_process_group by now, waiting for this rank
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.init_process_group("gloo")  # torch's default timeout: 30 minutes
    if cfg.case == "meet":
        meet(cfg, rank)
    seen = dict(train(cfg), case=cfg.case, lr=cfg.lr, lr_type=type(cfg.lr).__name__)
    seen.update(
        env={key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")},
        pid=os.getpid(),
        default_dtype=str(torch.get_default_dtype()),
        tasks_run_here=TASKS_RUN_HERE,
        affinity=sorted(os.sched_getaffinity(0)),
        started_at=started_at,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    (job_dir / "seen").mkdir(exist_ok=True)
    (job_dir / "seen" / f"rank{rank}.json").write_text(json.dumps(seen))
    return seen


class Record(Callback):
    def on_job_start(self, config, **kwargs):
        self.started = time.monotonic()

    def on_job_end(self, config, job_return, **kwargs):
        failed = job_return.status == JobStatus.FAILED
        entry = {
            "job": config.hydra.job.num,
            "status": job_return.status.name,
            "seconds": time.monotonic() - self.started,
            "value": None if failed else job_return.return_value,
            "error": f"{job_return._return_value!r}\n{getattr(job_return._return_value, '__notes__', '')}"
            if failed
            else None,
            "sweep_pid": os.getpid(),
            "process_group": torch.distributed.is_initialized(),
            "default_dtype": str(torch.get_default_dtype()),
            "cuda_initialized": torch.cuda.is_initialized(),
            "tasks_run_here": TASKS_RUN_HERE,
            "threads": sorted(thread.name for thread in threading.enumerate()),
            "environ": dict(os.environ),
        }
        with open(Path(config.hydra.sweep.dir) / "jobs.jsonl", "a") as jobs:
            jobs.write(json.dumps(entry) + "\n")


ConfigStore.instance().store(name="config", node=Config)

if os.environ.get("LAUNCHER_APP_TOUCH_CUDA"):
    torch.cuda.is_available()


def closure_of(run):
    def closure(cfg):  # a function no child can import by name
        return run(cfg)

    return closure


if __name__ == "__main__":
    main = closure_of(task) if os.environ.get("LAUNCHER_APP_CLOSURE") else task
    hydra.main(config_name="config", config_path=None, version_base="1.3")(main)()
