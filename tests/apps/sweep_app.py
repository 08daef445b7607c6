"""The app the end-to-end tests sweep: a tiny LightningModule that records what each rank saw.

Every rank writes what it saw to <job dir>/seen/<stage>_rank<N>.json, and its pid and state to
<job dir>/started/rank<N>.json as soon as its module is built. Failures are injected by
module.fail_rank / module.fail_how ("<init|rendezvous|train|end>_<raise|kill|hang|float64>") in job
module.fail_job: while the module is built, as the process group is about to be set up, in training,
or after the task function's last stage.
The task function runs the stages of ``stages``, each "<stage>[:<same|fresh module>[:<ckpt_path>]]",
then returns the metric ``objective`` names, if any (what an Optuna sweep optimizes).
"""

import datetime
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import hydra
import numpy
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.utils import get_original_cwd, instantiate
from hydra_zen import builds, make_config, store
from omegaconf import OmegaConf
from shapes import QUIET_CPU_TRAINER, Shapes, live_descendants, pl, regression_data
from shards import shards_of

from hydra_fsdp import HydraDDP, HydraFSDP, HydraModelParallel

STRATEGIES = {"ddp": HydraDDP, "fsdp": HydraFSDP, "model_parallel": HydraModelParallel}
# for a value per job, e.g. +hydra.job.env_set.OMP_NUM_THREADS='${plus:${hydra:job.num},1}'
OmegaConf.register_new_resolver("plus", lambda a, b: int(a) + int(b), replace=True)
JOBS_RUN_HERE = 0  # module state: how many jobs this process ran the task function of


def job_dir():
    return Path(HydraConfig.get().runtime.output_dir)


def local_rank():
    return int(os.environ.get("LOCAL_RANK", "0"))


def full_copy(module):
    """Whether this rank holds every parameter whole (DDP, one rank), not a shard of it."""
    held = [getattr(p, "to_local", lambda p=p: p)() for p in module.trainer.model.parameters()]
    return sum(p.numel() for p in held) == module.params_total


def tensor_parallel_shards_of(net, world=2):
    """What each of ``world`` ranks of ShardedTiny's tensor parallelism (data_parallel_size=1) should hold
    of ``net``'s full weights: the sum of each rank's part. ColwiseParallel splits net[0]'s weight and bias
    along dim 0, RowwiseParallel net[2]'s weight along dim 1 and leaves its bias whole on every rank."""
    parts = [float(net[2].bias.detach().double().sum())] * world
    for param, dim in ((net[0].weight, 0), (net[0].bias, 0), (net[2].weight, 1)):
        for rank, chunk in enumerate(torch.chunk(param.detach().double(), world, dim=dim)):
            parts[rank] += float(chunk.sum())
    return parts


class Tiny(pl.LightningModule):
    def __init__(
        self,
        lr=0.1,
        momentum=0.0,
        job=-1,
        tag="",
        stamp="",
        width=64,
        fail_rank=-1,
        fail_how="",
        fail_job=0,
        seed=None,
    ):
        super().__init__()
        self.seen = {"lr": lr, "job": job, "tag": tag, "stamp": stamp}
        self.momentum = momentum  # > 0: the optimizer has state, which a resume must restore
        self.fail = (fail_rank if job == fail_job else -1, fail_how)
        if seed is not None:  # the same initial weights on every rank, whichever strategy shards them
            torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        self.params_total = sum(p.numel() for p in self.net.parameters())
        started = job_dir() / "started"
        started.mkdir(exist_ok=True)
        # written whole, then renamed: the tests poll for it and must never read half of it; the
        # part is named by pid because two torchrun "nodes" on one machine share a local rank
        writing = started / f".rank{local_rank()}.{os.getpid()}.json.part"
        writing.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "ppid": os.getppid(),
                    "env": {
                        k: os.environ.get(k) for k in ("LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK")
                    },
                    "process_group": torch.distributed.is_initialized(),
                    "job_tag": os.environ.get("JOB_TAG"),
                    "threads": sorted(t.name for t in threading.enumerate()),
                }
            )
        )
        writing.rename(started / f"rank{local_rank()}.json")
        self._maybe_fail("init")

    def _maybe_fail(self, when):
        rank, how = self.fail
        if rank != local_rank() or not how.startswith(when):
            return
        if how.endswith("raise"):
            raise ValueError(f"injected failure on rank {rank}")
        if how.endswith("kill"):
            if when == "rendezvous":
                time.sleep(2)  # rank 0 waits for this rank in init_process_group by now
            os.kill(os.getpid(), 9)
        if how.endswith("hang"):
            time.sleep(10_000)
        if how.endswith("float64"):  # as an earlier job's torch.set_default_dtype(torch.float64) leaves it
            self.double()

    def configure_callbacks(self):  # Lightning's last call into the module before the rendezvous
        self._maybe_fail("rendezvous")
        return []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, idx):
        steps = job_dir() / "steps"  # rank<N>_<idx>: the steps each rank began (tests wait on them)
        steps.mkdir(exist_ok=True)
        (steps / f"rank{local_rank()}_{idx}").touch()
        if idx == 2:
            self._maybe_fail("train")
        if os.environ.get("APP_SLOW_STEPS"):
            time.sleep(float(os.environ["APP_SLOW_STEPS"]))
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    test_step = validation_step

    def predict_step(self, batch, idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.seen["lr"], momentum=self.momentum)

    def _data(self):
        return regression_data(seed=0, samples=64)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _data

    def _record(self, stage):
        held = [getattr(p, "to_local", lambda p=p: p)().detach() for p in self.trainer.model.parameters()]
        # on the module's device: NCCL reduces CUDA tensors only
        local_sum = torch.tensor(
            float(sum(p.double().sum() for p in held)), dtype=torch.float64, device=self.device
        )
        full_sum = local_sum.clone()
        torch.distributed.all_reduce(full_sum)
        datamodule = self.trainer.datamodule
        with torch.random.fork_rng(devices=[]):  # a draw that leaves the generator as it was
            torch_draw = float(torch.rand(1))
        seen = dict(
            self.seen,
            stage=stage,
            rank=self.global_rank,
            world=self.trainer.world_size,
            cwd=os.getcwd(),
            output_dir=HydraConfig.get().runtime.output_dir,
            original_cwd=get_original_cwd(),
            pid=os.getpid(),
            strategy=type(self.trainer.strategy).__module__ + "." + type(self.trainer.strategy).__name__,
            params_held=sum(p.numel() for p in held),
            params_total=self.params_total,
            local_weight_sum=float(local_sum),
            weight_sum=float(full_sum),
            datamodule=None if datamodule is None else type(datamodule).__name__,
            master_port=os.environ.get("MASTER_PORT"),
            # what a fresh process has of its own
            ppid=os.getppid(),
            jobs_run_here=JOBS_RUN_HERE,
            job_tag=os.environ.get("JOB_TAG"),
            threads=torch.get_num_threads(),
            omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
            affinity=sorted(os.sched_getaffinity(0)),
            fit_started=getattr(self, "fit_started", None),  # when it ran: jobs at once, or one at a time
            time=time.time(),
            numpy_draw=float(numpy.random.rand()),
            torch_draw=torch_draw,
            # a rank holding full weights (DDP): the sum of what each rank of a sharding strategy
            # should hold of them, FSDP's flat shards and FSDP2's rows, for its tests to compare with
            shards_should_hold=shards_of(self.net, self.trainer.world_size) if full_copy(self) else None,
            # and of tensor parallelism over 2 ranks (as one device trains: every rank sees every batch)
            tensor_parallel_should_hold=tensor_parallel_shards_of(self.net) if full_copy(self) else None,
            rank_zero_only_rank=pl.utilities.rank_zero_only.rank,
            strategy_namespace=type(self.trainer.strategy)._lightning.__name__,
            trainer_namespace=type(self.trainer).__module__.split(".trainer")[0],
        )
        sharding = (pl.strategies.FSDPStrategy, getattr(pl.strategies, "ModelParallelStrategy", ()))
        if self.trainer.world_size == 1 or not isinstance(self.trainer.strategy, sharding):
            seen["weight_sum"] = float(local_sum)
        out = job_dir() / "seen"
        out.mkdir(exist_ok=True)
        (out / f"{stage}_rank{self.global_rank}.json").write_text(json.dumps(seen))

    def on_fit_start(self):
        self.fit_started = time.time()

    def on_train_epoch_end(self):  # what ModelCheckpoint saves of this epoch: seen/epoch<N>_rank<R>.json
        self._record(f"epoch{self.current_epoch}")

    def on_train_end(self):
        self._record("fit")

    def on_validation_end(self):
        if self.trainer.state.fn == "validate":
            self._record("validate")

    def on_test_end(self):
        self._record("test")

    def on_predict_end(self):
        self._record("predict")


class ShardedTiny(Tiny):
    """Tiny for HydraModelParallel: FSDP2 over the mesh's data_parallel dimension (and, with
    tensor_parallel_size=2, tensor parallelism over the other), applied once (fail_how=configure_twice: at
    every stage, which torch refuses)."""

    def configure_model(self):
        try:
            from torch.distributed.fsdp import FSDPModule, fully_shard
        except ImportError:  # torch 2.4, 2.5
            from torch.distributed._composable.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if isinstance(self.net, FSDPModule) and self.fail[1] != "configure_twice":
            return
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            parallelize_module(
                self.net, mesh["tensor_parallel"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
            )
        for layer in (self.net[0], self.net[2], self.net):
            fully_shard(layer, mesh=mesh["data_parallel"])


class SlowOnException(pl.Callback):
    """With APP_ON_EXCEPTION_SECONDS set, on every rank: on_exception takes that long (as a logger's finalize
    does: an upload), then writes <job dir>/on_exception_rank<R> holding the exception's type."""

    def on_exception(self, trainer, pl_module, exception):
        time.sleep(float(os.environ["APP_ON_EXCEPTION_SECONDS"]))
        (job_dir() / f"on_exception_rank{local_rank()}").write_text(type(exception).__name__)


class _Tee:
    """A stream that also writes to a file."""

    def __init__(self, stream, path):
        self.stream, self.file = stream, open(path, "w")  # noqa: SIM115 - closed by RecordError

    def write(self, text):
        self.file.write(text)
        return self.stream.write(text)

    def flush(self):
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


class RecordError(Callback):
    """``+hydra.callbacks.record_error._target_=__main__.RecordError``: a failed job's error, as Hydra
    would print it, in <job dir>/error.txt (at a sweep's end Hydra prints its first failed job's alone),
    followed by what rank 0 wrote to stderr in the job (where hydra_fsdp puts an error's notes before
    Python 3.11)."""

    def on_job_start(self, config, **kwargs):
        sys.stderr = _Tee(sys.stderr, job_dir() / "stderr.txt")

    def on_job_end(self, config, job_return, **kwargs):
        tee, sys.stderr = sys.stderr, sys.stderr.stream
        tee.file.close()
        if job_return.status == JobStatus.FAILED:
            error = "".join(traceback.format_exception(job_return._return_value))
            (job_dir() / "error.txt").write_text(error + (job_dir() / "stderr.txt").read_text())


class RecordAlive(Callback):
    """``+hydra.callbacks.record_alive._target_=__main__.RecordAlive``: the processes below the sweep's
    process (rank 0) as each job starts, before hydra_fsdp starts its ranks, and as it ends, after
    hydra_fsdp ended them (Hydra calls a job's end callbacks last-added first: hydra_fsdp's, added at
    the first job's launch, runs before this one), in <job dir>/alive_at_start.json and
    alive_at_end.json: what a job left running, seen while the sweep still runs."""

    def on_job_start(self, config, **kwargs):
        (job_dir() / "alive_at_start.json").write_text(json.dumps(live_descendants()))

    def on_job_end(self, config, job_return, **kwargs):
        (job_dir() / "alive_at_end.json").write_text(json.dumps(live_descendants()))


class RecordProcess(Callback):
    """``+hydra.callbacks.record_process._target_=__main__.RecordProcess``: what the sweep's process (rank 0
    of every job of the basic launcher) runs on after the sweep, in <sweep dir>/process_after.json."""

    def on_multirun_end(self, config, **kwargs):
        state = {
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "affinity": sorted(os.sched_getaffinity(0)),
        }
        (Path(config.hydra.sweep.dir) / "process_after.json").write_text(json.dumps(state))


Trainer = builds(
    pl.Trainer,
    **QUIET_CPU_TRAINER,
    callbacks=None,
    # the process group's timeout, torch's default (30 min) unless a job sets trainer.strategy.timeout.seconds
    strategy=builds(
        STRATEGIES[os.environ.get("APP_STRATEGY", "ddp")],
        rank_timeout=60,
        timeout=builds(datetime.timedelta, seconds=1800),
    ),
    populate_full_signature=True,
)
Config = make_config(
    trainer=Trainer,
    module=builds(
        ShardedTiny if os.environ.get("APP_STRATEGY") == "model_parallel" else Tiny,
        job="${hydra:job.num}",
        tag="${hydra:job.override_dirname}",
        stamp="${now:%H-%M-%S-%f}",
        populate_full_signature=True,
    ),
    datamodule=builds(Shapes),
    stages=["fit"],
    use_datamodule=False,
    rank0_callback=False,  # rank 0 alone gets an extra callback: ranks that would deadlock
    loaders_in_call=False,  # pass the dataloaders straight to trainer.fit/validate/...
    # for a sweeper that optimizes what the task function returns (Optuna): a metric the stages logged
    # (e.g. val_loss), returned by every rank and recorded in <job dir>/returned/rank<N>.json, for the
    # tests to compare with what the sweeper told its study; None returns nothing and records nothing
    objective=None,
    # every rank writes relative_rank<N>.txt, by that relative path, holding its os.getcwd(): where
    # hydra.job.chdir=True put it (in the job's dir, every rank)
    write_relative=False,
    # for trainer.callbacks=[${keep_last}]: lets a stage load ckpt_path="last"
    keep_last=builds(pl.callbacks.ModelCheckpoint, save_last=True),
    # for trainer.callbacks=[${best_is_first},${keep_last}]: "best" is the epoch of the highest validation
    # loss, the first (training lowers it), so that loading best is told apart from loading last and from
    # nothing. Its own file name, and no save_last: ModelCheckpoint writes last.ckpt only as it saves a
    # checkpoint, so a monitored one's last.ckpt would be its best; keep_last's is the last epoch's. Listed
    # first, it is the Trainer's checkpoint_callback, whose best ckpt_path="best" loads.
    best_is_first=builds(
        pl.callbacks.ModelCheckpoint, monitor="val_loss", mode="max", save_top_k=1, filename="best-{epoch}"
    ),
    # for the cases of one shared sweep (tests/shared.py), which cannot add keys to trainer.strategy's typed
    # node, nor replace it: the sweep passes trainer.strategy='${strategies.${strategies.use}}', and each
    # case picks one and sets its arguments, e.g. {"strategies.use": "model_parallel",
    # "strategies.model_parallel.data_parallel_size": 2}
    strategies=make_config(
        use=os.environ.get("APP_STRATEGY", "ddp"),
        ddp=builds(HydraDDP, rank_timeout=60, timeout=builds(datetime.timedelta, seconds=1800)),
        **(
            {
                "model_parallel": builds(
                    HydraModelParallel,
                    rank_timeout=60,
                    timeout=builds(datetime.timedelta, seconds=1800),
                    data_parallel_size="auto",
                    tensor_parallel_size="auto",
                    save_distributed_checkpoint=True,
                )
            }
            if os.environ.get("APP_STRATEGY") == "model_parallel"
            else {}
        ),
    ),
)


def task(cfg):
    global JOBS_RUN_HERE
    JOBS_RUN_HERE += 1
    extra = (
        [pl.callbacks.EarlyStopping(monitor="val_loss")] if cfg.rank0_callback and local_rank() == 0 else []
    )
    extra += [SlowOnException()] if os.environ.get("APP_ON_EXCEPTION_SECONDS") else []
    trainer = instantiate(cfg.trainer, callbacks=extra + list(cfg.trainer.callbacks or []))
    module = instantiate(cfg.module)
    datamodule = instantiate(cfg.datamodule) if cfg.use_datamodule else None
    if cfg.write_relative:
        Path(f"relative_rank{local_rank()}.txt").write_text(os.getcwd())
    for spec in cfg.stages:
        stage, which, ckpt = (spec.split(":") + ["same", "none"])[:3]
        if which == "fresh":
            module = instantiate(cfg.module)
        kwargs = {} if datamodule is None else {"datamodule": datamodule}
        if cfg.loaders_in_call:
            kwargs["train_dataloaders" if stage == "fit" else "dataloaders"] = module._data()
        if ckpt != "none":
            kwargs["ckpt_path"] = ckpt
        getattr(trainer, stage)(module, **kwargs)
    module._maybe_fail("end")
    if cfg.objective is not None:
        returned = float(trainer.callback_metrics[cfg.objective])
        (job_dir() / "returned").mkdir(exist_ok=True)
        (job_dir() / "returned" / f"rank{local_rank()}.json").write_text(json.dumps(returned))
        return returned
    return None


if __name__ == "__main__":
    store(Config, name="config")
    store.add_to_hydra_store()
    # APP_CLOSURE: a task function no child can import, for the fallback
    run = (lambda cfg: task(cfg)) if os.environ.get("APP_CLOSURE") else task
    hydra.main(config_name="config", config_path=None, version_base="1.3")(run)()
