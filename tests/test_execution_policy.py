"""Hydra 1.4's execution whitelist holds on every rank: a real sweep (2 jobs x 2 CPU ranks) of
tests/apps/typed_app/policy_app.py, whose ``@hydra.main(execution_whitelist=...)`` allows a target Hydra
refuses by default and refuses one Hydra allows by default. Each rank must do what rank 0 did, as it
records it."""

import inspect
import json
import shutil
import sys

import pytest
from helpers import APPS, app_env, ok, run
from hydra import main as hydra_main

pytestmark = pytest.mark.skipif(
    "execution_whitelist" not in inspect.signature(hydra_main).parameters,
    reason="hydra-core < 1.4 has no execution whitelist",
)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    app = tmp_path_factory.mktemp("policy") / "app"
    shutil.copytree(APPS / "typed_app", app)
    command = [sys.executable, "policy_app.py", "-m", "hydra.sweep.dir=sweep", "lr=0.1,0.2"]
    return run(command, app, app_env()), app / "sweep"


@pytest.mark.parametrize("job", [0, 1])
def test_every_rank_runs_under_rank0s_execution_whitelist(sweep, job):
    proc, sweep_dir = sweep
    ok(proc)
    seen = {
        rank: json.loads((sweep_dir / str(job) / "policy" / f"rank{rank}.json").read_text())
        for rank in (0, 1)
    }
    assert seen[0]["lr"] == seen[1]["lr"] == [0.1, 0.2][job]
    # the whitelist allows os.chdir (blacklisted without it) and refuses what it does not list
    expected = {"allowed": "allowed", "refused": "InstantiationException"}
    assert {key: seen[0][key] for key in expected} == expected, seen[0]
    assert {key: seen[1][key] for key in expected} == expected, f"rank 1 under another policy: {seen[1]}"
