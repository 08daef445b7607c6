"""External launchers: torchrun starts every rank, each running the whole sweep; we step aside.

Each process composes the sweep itself, so every job must still train with the full world size
on one output dir and config, reuse the engine's rendezvous job after job, and fail fast (not
hang) when the launched world does not match ``num_nodes x devices``.
"""

import json
import sys
import time

import pytest
from helpers import (
    SWEEP_TIMEOUT,
    SWEPT,
    SWEPT_LR_VALUES,
    SWEPT_TARGETS,
    Run,
    app_env,
    assert_ranks_agree,
    free_port,
    records,
    swept_jobs,
)


def torchrun(app_dir, *overrides, nnodes=1, nproc=2, strategy="ddp", timeout=SWEEP_TIMEOUT, env=None):
    """Run the sweep under torchrun: ``nnodes`` agents on 127.0.0.1, ``nproc`` processes each.

    The agents run side by side, each in a session of its own with its output in a file; if any
    is not done in ``timeout`` s, all of them and their workers are ended, and the failure shows
    what every agent wrote.
    """
    env = app_env(strategy, env)
    port = free_port()
    agents = [
        Run([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
             "app.py", "-m", "hydra.sweep.dir=sweep", *overrides], app_dir, env)
        for node in range(nnodes)
    ]  # fmt: skip
    started = time.monotonic()
    try:
        for agent in agents:
            agent.wait(timeout=max(1.0, started + timeout - time.monotonic()))
    except AssertionError as timed_out:
        raise AssertionError(
            f"{timed_out}\n"
            + "\n".join(f"--- agent {n} ---\n{a.text()[-4000:]}" for n, a in enumerate(agents))
        ) from None
    finally:
        for agent in agents:
            agent.end()
    output = "\n".join(agent.text() for agent in agents)
    return [agent.returncode for agent in agents], output, time.monotonic() - started


@pytest.mark.parametrize("nnodes, nproc", [(1, 2), (2, 1)], ids=["1 node x 2", "2 nodes x 1"])
def test_torchrun_sweep(app, nnodes, nproc, tmp_path):
    claims = tmp_path / "claims"  # the engine assigns the devices: nothing may be claimed
    codes, output, seconds = torchrun(
        app,
        f"trainer.strategy._target_={SWEPT_TARGETS}",  # both strategies on the engine's one process group
        f"module.lr={SWEPT_LR_VALUES}",
        "module.stamp=same-on-every-rank",  # ${now:%f} would differ per process: see the next tests
        f"trainer.num_nodes={nnodes}",
        f"trainer.devices={nproc}",
        nnodes=nnodes,
        nproc=nproc,
        env={"HYDRA_FSDP_CLAIMS": str(claims)},
    )
    assert codes == [0] * nnodes, output[-6000:]
    assert not claims.exists(), "under torchrun no job claims a device"
    engine_env = None
    jobs = [(job, strategy, lr) for strategy in SWEPT for job, lr in swept_jobs(strategy)]
    for job, strategy, lr in jobs:
        job_dir = app / "sweep" / str(job)
        seen = assert_ranks_agree(job_dir)  # both ranks, one output dir, one config, world size 2
        assert seen[0]["lr"] == seen[1]["lr"] == lr and seen[1]["job"] == job
        assert seen[0]["strategy"] == f"hydra_fsdp.Hydra{strategy.upper()}"
        assert not (job_dir / "rank_1.log").exists(), "under torchrun HydraDDP/HydraFSDP start no process"
        if strategy == "fsdp":
            assert seen[0]["params_held"] + seen[1]["params_held"] == seen[0]["params_total"]
        # the engine's rendezvous is reused job after job, its environment left as it set it
        start = json.loads((job_dir / "started" / "rank0.json").read_text())
        assert start["env"]["WORLD_SIZE"] == "2" and start["env"]["MASTER_PORT"] is not None
        engine_env = engine_env or start["env"]
        assert start["env"] == engine_env
    print(f"torchrun {nnodes} node(s) x {nproc}, {len(jobs)} jobs of {SWEPT}: {seconds:.1f} s")


def test_torchrun_world_size_mismatch_fails_fast(app):
    codes, output, seconds = torchrun(app, "module.lr=0.1", nnodes=1, nproc=1, timeout=120)
    assert codes != [0]
    assert "RankLaunchError" in output
    assert "started 1 processes" in output and "num_nodes x devices = 1 x 2 = 2" in output
    assert seconds < 60, f"took {seconds:.0f} s: it must fail before any rendezvous"
    assert not records(app / "sweep" / "0")


def test_ranks_that_resolve_different_configs_fail_at_setup(app):
    # the app's config holds stamp=${now:%H-%M-%S-%f}: each process resolves its own present
    codes, output, seconds = torchrun(app, "module.lr=0.1", timeout=120)
    assert codes != [0]
    assert "disagree on it" in output and "config.module.stamp: rank 0 '" in output
    assert "hydra.runtime.output_dir" not in output.split("disagree on it")[1].split("Build the same")[0]
    assert not records(app / "sweep" / "0")
    assert seconds < 90


def test_ranks_that_resolve_different_job_dirs_fail_at_setup(app):
    # each process resolves its own sweep dir: the split a ${now:...} a second apart causes
    codes, output, seconds = torchrun(
        app, "hydra.sweep.dir=sweep_${oc.env:RANK}", "module.stamp=same", "module.lr=0.1", timeout=120
    )
    assert codes != [0]
    assert "hydra.runtime.output_dir: rank 0 " in output and "sweep_0/0" in output and "sweep_1/0" in output
    assert not records(app / "sweep_0" / "0") and not records(app / "sweep_1" / "0")
    assert seconds < 90
