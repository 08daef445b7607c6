"""A sweep whose rank 0 records, at each job's start, what the jobs before it left behind.

Python's automatic gc is off, so that what is still alive before a collection is deterministic: at
the start of every job, rank 0 (the sweep process; under torchrun every rank) writes to
<job dir>/memory_rank<N>.json the bytes of
live CPU tensors (each storage counted once) before and after ``gc.collect()``, and whether the
process group and backends of the job before are still alive (weak references taken in its stage), and
how many DeviceMeshes are alive.

The model holds 2 x Linear(1600, 1600), 20.5 MB, trained with SGD with momentum, fit then
test(ckpt_path="best") with a checkpoint of the best epoch. ``plan`` says, per job number, the
strategy (HydraDDP, HydraFSDP and its checkpoint layout, or HydraModelParallel: fsdp2), whether the job
fails and whether the task function returns the module:
"<ddp|full|sharded|fsdp2>[:fail<rank>|:oom<rank>][:return]" (the failing rank raises in its second
training step: a ValueError, or CUDA's out-of-memory error). On a GPU memory_rank0.json also holds
``torch.cuda.memory_allocated()`` before and after the gc, and ``memory_reserved()``. Each
rank writes <job dir>/env_rank<N>.json, NCCL's error handling variables as it trains, and rank 0
<job dir>/done.json once the task function's stages are done. APP_CLOSURE makes the task
function one no child can import, so the children fall back to the config contract: they build
the config's strategy, APP_STRATEGY's (ddp or fsdp, full), whatever the plan says.
"""

import gc
import json
import os
import sys
import weakref
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from hydra_zen import builds, make_config, store
from shapes import live_descendants, pl

from hydra_fsdp import HydraDDP, HydraFSDP, HydraModelParallel

WIDTH = 1600
PREVIOUS_GROUP: list = []  # weak references to the process group and backends of the last job
KEPT: list = []  # what KeepReturns saw


class KeepReturns(Callback):
    """A user's Hydra callback: at each job's end it keeps the JobReturn, as a user's code may."""

    def on_job_end(self, config, job_return, **kwargs):
        KEPT.append(job_return)


def live_device_meshes() -> int:
    if "torch.distributed.device_mesh" not in sys.modules:
        return 0
    from torch.distributed.device_mesh import DeviceMesh

    return sum(isinstance(obj, DeviceMesh) for obj in gc.get_objects())


def live_tensor_bytes() -> int:
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class Big(pl.LightningModule):
    def __init__(self, job: int = 0, plan: tuple = ("full",)):
        super().__init__()
        failing = [part for part in plan[job].split(":") if part.startswith(("fail", "oom"))]
        self.fail_rank, self.fail_how = (int(failing[0][-1]), failing[0][:-1]) if failing else (-1, "")
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)
        )

    def forward(self, x):
        return self.net(x)

    def configure_model(self):  # HydraModelParallel's FSDP2, once; nothing to do under the others
        if getattr(self, "device_mesh", None) is not None and "FSDP" not in type(self.net).__name__:
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:  # torch 2.4, 2.5
                from torch.distributed._composable.fsdp import fully_shard

            for layer in (self.net[0], self.net[2], self.net):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, idx):
        if idx == 1 and self.global_rank == self.fail_rank:
            if self.fail_how == "oom":  # the most common failure of multi-GPU training
                torch.empty(1 << 50, dtype=torch.uint8, device=self.device)
            raise ValueError(f"injected failure on rank {self.global_rank}")
        return self(batch[0]).pow(2).mean()

    def validation_step(self, batch, idx):
        self.log("val_loss", self(batch[0]).pow(2).mean(), sync_dist=True)

    test_step = validation_step

    def on_train_start(self):
        group = torch.distributed.group.WORLD
        backends = [group._get_backend(torch.device(device)) for device in group._device_types]
        PREVIOUS_GROUP[:] = [weakref.ref(group)] + [weakref.ref(backend) for backend in backends]
        nccl = {key: os.environ.get(key) for key in ENV_SEEN}
        Path(HydraConfig.get().runtime.output_dir, f"env_rank{self.global_rank}.json").write_text(
            json.dumps(nccl)
        )

    def on_train_end(self):
        self.trained_sum = float(sum(p.detach().double().sum() for p in self.parameters()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def _data(self):
        x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)

    train_dataloader = val_dataloader = test_dataloader = _data


ENV_SEEN = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT")
STRATEGY = {
    "ddp": builds(HydraDDP, rank_timeout=60),
    "fsdp": builds(HydraFSDP, rank_timeout=60, state_dict_type="full"),
    "fsdp2": builds(HydraModelParallel, rank_timeout=60, data_parallel_size=2, tensor_parallel_size=1),
}
Config = make_config(
    trainer=builds(
        pl.Trainer,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=1,
        limit_test_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir="${hydra:runtime.output_dir}",
        callbacks=[builds(pl.callbacks.ModelCheckpoint, monitor="val_loss", save_top_k=1)],
        strategy=STRATEGY[os.environ.get("APP_STRATEGY", "ddp")],
    ),
    module=builds(Big, job="${hydra:job.num}", plan="${plan}"),
    plan=["full"],
)


def record_what_is_left():
    if "HYDRA_FSDP_CONFIG" in os.environ:  # a child rank hydra_fsdp started: a fresh process every job
        return
    # hydra_fsdp froze what the job found alive (so that its end scans only the job's own objects), and
    # gc.get_objects() lists no frozen object: unfrozen to count it all, frozen again after
    frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    cuda = torch.cuda.is_initialized()
    before = {
        "before_gc": live_tensor_bytes(),
        "cuda_allocated_before_gc": cuda and torch.cuda.memory_allocated(),
        "device_meshes_before_gc": live_device_meshes(),
    }
    group_alive_before = [ref() is not None for ref in PREVIOUS_GROUP]
    gc.collect()
    memory = {
        **before,
        "after_gc": live_tensor_bytes(),
        "cuda_allocated": cuda and torch.cuda.memory_allocated(),
        "cuda_reserved": cuda and torch.cuda.memory_reserved(),  # what the last job's end gave back
        "group_alive_before_gc": group_alive_before,
        "group_alive_after_gc": [ref() is not None for ref in PREVIOUS_GROUP],
        "process_group": torch.distributed.is_initialized(),
        # the processes below the sweep's as the job starts: no child rank of an earlier job among them
        "alive": list(live_descendants()),
    }
    if frozen:
        gc.freeze()
    rank = os.environ.get("RANK", "0")  # every rank is a sweep process under torchrun
    Path(HydraConfig.get().runtime.output_dir, f"memory_rank{rank}.json").write_text(json.dumps(memory))


def task(cfg):
    record_what_is_left()
    plan = cfg.plan[HydraConfig.get().job.num].split(":")
    cfg.trainer.strategy = STRATEGY[plan[0] if plan[0] in ("ddp", "fsdp2") else "fsdp"]
    if plan[0] in ("full", "sharded"):
        cfg.trainer.strategy.state_dict_type = plan[0]
    trainer = instantiate(cfg.trainer)
    module = instantiate(cfg.module)
    trainer.fit(module)
    trainer.test(module, ckpt_path="best")
    if trainer.global_rank == 0:
        Path(HydraConfig.get().runtime.output_dir, "done.json").write_text(
            json.dumps(trainer.checkpoint_callback.best_model_path)
        )
    return module if "return" in plan else None


if __name__ == "__main__":
    gc.disable()  # what a job leaves is then still there at the next one's start, unless freed on purpose
    store(Config, name="config")
    store.add_to_hydra_store()
    # APP_CLOSURE: a task function no child can import, for the fallback
    run = (lambda cfg: task(cfg)) if os.environ.get("APP_CLOSURE") else task
    hydra.main(config_name="config", config_path=None, version_base="1.3")(run)()
