"""Jobs at once under hydra-ray-launcher (``hydra/launcher=ray``), on a local Ray of the sweep's own.

Each job is a Ray task in a reused Ray worker (whose ``__main__`` is Ray's ``default_worker.py``). Ray
runs as many tasks at once as their ``num_cpus`` fit in its CPUs, but pins none: a job claims
``hydra.launcher.ray.remote.num_cpus`` cores (hydra_fsdp._cores_per_job), so that jobs Ray runs at once
run on cores of their own. Ray sets ``OMP_NUM_THREADS`` to a task's ``num_cpus`` where the worker's
environment lacks it: that is not the user's (hydra_fsdp._users_threads), each rank runs its share.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import APPS, Run, app_env, records, sweeper_or_skip, wait_all
from shared import case_overrides, nothing_outlives

sweeper_or_skip("ray", "pip install ray")
sweeper_or_skip("hydra_plugins.hydra_ray_launcher", "pip install hydra-ray-launcher")

CORES = sorted(os.sched_getaffinity(0))[:2]  # the sweep runs on two cores, whatever the machine has
if len(CORES) < 2:
    pytest.skip("needs 2 CPU cores", allow_module_level=True)

# The sweep's process on CORES, then the sweep (Ray's processes inherit the affinity)
PINNED = (
    "import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')]);"
    " os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def ray_overrides(temp_dir):
    """A local Ray of the sweep's own, which it starts and ends: 2 CPUs, 1 for each job's task."""
    return (
        "hydra/launcher=ray",
        "++hydra.launcher.ray.init.address=local",
        f"++hydra.launcher.ray.init._temp_dir={temp_dir}",
        "++hydra.launcher.ray.init.include_dashboard=false",
        "++hydra.launcher.ray.init.num_cpus=2",
        "++hydra.launcher.ray.remote.num_cpus=1",
    )


def ray_processes(temp_dir):
    """Live processes whose command line names the Ray's temp dir (its raylet, GCS, workers...)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and temp_dir.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One sweep of the YAML app, 2 jobs x 2 ranks, HydraDDP on the CPU: ``ok`` trains, ``failed``'s rank 1
    raises once it recorded its fit; both trained at once (the first to train waits for the other)."""
    project = Path(shutil.copytree(APPS / "yaml_app", tmp_path_factory.mktemp("ray") / "yaml_app"))
    # short: Ray's sockets live in it (a unix socket's path is at most 107 bytes)
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    cases = case_overrides(project, {"ok": {"model.lr": 0.1}, "failed": {"model.fail_rank": 1}})
    env = {"APP_MEET_IN": str(tmp_path_factory.mktemp("meeting")), "RAY_USAGE_STATS_ENABLED": "0"}
    command = [sys.executable, "-c", PINNED, ",".join(map(str, CORES)), "train.py", "-m"]
    try:
        with nothing_outlives("the Ray sweep"):
            env = app_env(env=env)
            env.pop("OMP_NUM_THREADS", None)  # the user sets none: Ray does
            overrides = ["hydra.sweep.dir=sweep", "test=false", *ray_overrides(temp_dir), *cases]
            run = Run([*command, *overrides], project, env)
            wait_all([run])
            deadline = time.monotonic() + 10  # as the leak check: a process may take a moment to end
            while (left := ray_processes(temp_dir)) and time.monotonic() < deadline:
                time.sleep(0.2)
        yield project / "sweep", run, left
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_jobs_ray_runs_at_once_run_at_once_on_cores_of_their_own(sweep):
    """Each job claims its task's 1 CPU: the two start together, on disjoint cores, each rank one thread
    (Ray's OMP_NUM_THREADS=1 would say so too; not what a rank runs by: see
    test_rays_omp_num_threads_is_not_taken_for_the_users)."""
    sweep_dir, run, _ = sweep
    held, windows = {}, {}
    for job in ("ok", "failed"):
        seen = records(sweep_dir / job)
        assert sorted(seen) == [0, 1], run.text()[-6000:]
        held[job] = {core for rank in seen.values() for core in rank["affinity"]}
        assert len(held[job]) == 1, (job, seen)
        for rank in seen.values():
            assert rank["threads"] == 1 and rank["omp_num_threads"] == "1", (job, rank)
            assert rank["world"] == 2 and rank["strategy"] == "hydra_fsdp.lightning.HydraDDP"
        assert seen[0]["pid"] != seen[1]["pid"]
        windows[job] = (min(r["fit_started"] for r in seen.values()), max(r["time"] for r in seen.values()))
    assert not held["ok"] & held["failed"], held
    (start_a, end_a), (start_b, end_b) = windows.values()
    assert start_a < end_b and start_b < end_a, f"the jobs did not run at once: {windows}"
    assert "this job waits for" not in run.text()


def test_a_failed_rank_fails_its_job_naming_it(sweep):
    sweep_dir, run, _ = sweep
    assert run.returncode != 0, "Hydra exits non-zero when a job of the sweep failed"
    text = run.text()
    assert "Child rank 1 failed" in text and "injected failure on rank 1" in text, text[-6000:]
    failed = [line for line in text.splitlines() if line.startswith("Error executing job with overrides")]
    assert failed == ["Error executing job with overrides: ['test=False', '+case=failed']"], text[-6000:]
    assert "Traceback" not in (sweep_dir / "ok" / "rank_1.log").read_text()


def test_nothing_of_rays_is_left_running(sweep):
    """Ray's processes (raylet, GCS, workers) ended with the sweep (and, the fixture checks, every process
    the sweep started: the ranks' fork servers in Ray's workers too)."""
    _, _, left = sweep
    assert left == [], f"Ray's processes still running after the sweep: {left}"


USERS_THREADS = """
import json, os, sys
import hydra_fsdp
found = []
for launcher, set_later in json.loads(sys.argv[1]):
    hydra_fsdp.HydraConfig.get = lambda: {"launcher": {launcher: {}}}
    if set_later:  # as Ray does in its worker as a task starts, where the worker's environment lacks it
        os.environ["OMP_NUM_THREADS"] = set_later
    found.append(hydra_fsdp._users_threads())
print(json.dumps(found))
"""


def users_threads(at_start, cases):
    """Start a process with ``OMP_NUM_THREADS=at_start`` (None: without it), which tells for each
    (launcher, value set in the process) whether hydra_fsdp takes the value for the user's."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update({"OMP_NUM_THREADS": at_start} if at_start else {})
    command = [sys.executable, "-c", USERS_THREADS, json.dumps(cases)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_rays_omp_num_threads_is_not_taken_for_the_users():
    """Under the Ray launcher an OMP_NUM_THREADS set in the process (Ray's) is not the user's: the ranks
    run their share (with remote.num_cpus=2 and 2 ranks, Ray's 2 would be 2 threads on 1 core each); one
    in the environment the process started with is. Under other launchers any value stands."""
    started = [
        users_threads(None, [["ray", None], ["ray", "2"], ["n_jobs", "2"]]),
        users_threads("3", [["ray", None]]),
    ]
    found = [proc.communicate(timeout=120) for proc in started]
    assert [json.loads(out or "null") for out, _ in found] == [[False, False, True], [True]], found
