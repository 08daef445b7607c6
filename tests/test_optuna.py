"""Optuna: a trial whose child rank fails is told to the study as FAIL, and hydra-optuna-sweeper's
``max_failure_rate`` decides whether the study goes on.

Three sweeps of the same 4 trials (2-rank HydraDDP jobs on the CPU), a grid over module.lr, run two
at a time, the third under hydra/launcher=hydra_fsdp (every rank a fresh process): trial 1 (the
second of the first batch, hydra.sweeper.n_jobs=2) fails on rank 1. The sweeper compares each batch's
failures with max_failure_rate: 1 of 2 is 0.5, not above 0.5, so at 0.5 the study goes on to the
second batch; at the default, 0.0, the sweep raises the failed job's error after the first batch.
The study is read from its storage (tests/apps/recorded_study.py), each trial's job from what its
ranks recorded and returned.
"""

import functools
import json
import shutil

import pytest
from helpers import (
    APPS,
    assert_ranks_agree,
    copy_app,
    records,
    run_side_by_side,
    start_sweep,
    sweeper_or_skip,
)
from omegaconf import OmegaConf
from shared import nothing_outlives

sweeper_or_skip("hydra_plugins.hydra_optuna_sweeper", "pip install hydra-optuna-sweeper")

LRS = (0.05, 0.1, 0.2, 0.4)  # a grid: each trial its own lr, whichever order the sampler takes them in
FAILING_TRIAL = 1
RATES = {"0.5": ("hydra.sweeper.max_failure_rate=0.5",), "default": ()}
# the same study as "0.5", every rank of every trial a process of its own (rank 0 too): the study receives
# what each trial's rank 0 returned, through the launcher
RATES["launcher"] = (*RATES["0.5"], "hydra/launcher=hydra_fsdp", "hydra.launcher.nproc_per_node=2")
# how each names the failing trial's rank: the strategy, in the sweep's process; the launcher, from outside
FAILED = {"0.5": "ChildRankError: Child rank 1 failed", "launcher": "ChildRankError: Rank 1 failed first"}


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """The sweeps, two at a time: {rate: (app dir, run, the study's trials by number)}."""
    apps, starts = {}, []
    for rate, overrides in RATES.items():
        app = apps[rate] = copy_app(tmp_path_factory.mktemp(f"optuna_{rate}"))
        shutil.copy(APPS / "recorded_study.py", app)
        storage = f"{{_target_:recorded_study.RecordedStorage,path:{app / 'study.json'}}}"
        starts.append(
            functools.partial(
                start_sweep,
                app,
                "hydra/sweeper=optuna",
                "hydra/sweeper/sampler=grid",
                "hydra.sweeper.n_trials=4",
                "hydra.sweeper.n_jobs=2",  # the batch whose failure rate is compared; Optuna's default
                f"hydra.sweeper.storage={storage}",
                *overrides,
                "module.lr=choice(" + ",".join(map(str, LRS)) + ")",
                "objective=val_loss",
                f"module.fail_job={FAILING_TRIAL}",
                "module.fail_rank=1",
                "module.fail_how=train_raise",
                "+hydra.callbacks.record_error._target_=__main__.RecordError",
            )
        )
    with nothing_outlives("this module's sweeps"):
        runs = run_side_by_side(starts, at_once=2)
    return {
        rate: (app, proc, {t["number"]: t for t in json.loads((app / "study.json").read_text())})
        for (rate, app), proc in zip(apps.items(), runs)
    }


def returned(job_dir):
    """What each rank's task function returned: {rank: value}."""
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (job_dir / "returned").glob("rank*.json")}


def assert_trained_and_returned(app, trial):
    """The trial's job trained on both ranks with the trial's lr, and the study holds what rank 0
    returned (rank 1 returned the same: val_loss is reduced across the ranks)."""
    job_dir = app / "sweep" / str(trial["number"])
    seen = assert_ranks_agree(job_dir)
    assert seen[0]["lr"] == seen[1]["lr"] == trial["params"]["module.lr"], (trial, seen[0]["lr"])
    assert seen[0]["job"] == trial["number"]
    values = returned(job_dir)
    assert sorted(values) == [0, 1], f"ranks that returned: {sorted(values)}"
    assert trial["values"] == [values[0]] and values[1] == values[0], (trial, values)


@pytest.mark.parametrize("study", FAILED)
def test_a_failed_child_rank_fails_its_trial_and_the_study_goes_on(studies, study):
    _, proc, trials = studies[study]
    assert proc.returncode == 0, proc.text()[-9000:]
    states = {number: trial["state"] for number, trial in trials.items()}
    assert states == {0: "COMPLETE", 1: "FAIL", 2: "COMPLETE", 3: "COMPLETE"}, states
    assert sorted(trial["params"]["module.lr"] for trial in trials.values()) == list(LRS)
    assert trials[FAILING_TRIAL]["values"] is None


@pytest.mark.parametrize("study", FAILED)
@pytest.mark.parametrize("number", [0, 2, 3])
def test_every_other_trial_trained_on_both_ranks_and_reported_its_value(studies, number, study):
    app, _, trials = studies[study]
    assert_trained_and_returned(app, trials[number])


@pytest.mark.parametrize("study", FAILED)
def test_the_failed_trial_is_rank_1s_error_and_trained_nowhere(studies, study):
    app, proc, _ = studies[study]
    job_dir = app / "sweep" / str(FAILING_TRIAL)
    error = (job_dir / "error.txt").read_text()
    assert FAILED[study] in error and "injected failure on rank 1" in error, error
    assert not records(job_dir) and not (job_dir / "returned").exists()
    # the sweeper logs the failure and goes on
    failed = FAILED[study].split(": ", 1)[1]
    assert f"Failed experiment: {failed}" in proc.text(), proc.text()[-9000:]


@pytest.mark.parametrize("study", FAILED)
def test_the_best_trial_is_the_best_value_a_rank_0_returned(studies, study):
    app, _, trials = studies[study]
    completed = [trial for trial in trials.values() if trial["state"] == "COMPLETE"]
    best = min(completed, key=lambda trial: trial["values"][0])
    results = OmegaConf.load(app / "sweep" / "optimization_results.yaml")
    assert results.best_value == best["values"][0] and results.best_params == best["params"], results
    assert best["values"] == [returned(app / "sweep" / str(best["number"]))[0]]


def test_at_the_default_rate_the_sweep_ends_after_the_failing_trials_batch(studies):
    app, proc, trials = studies["default"]
    assert proc.returncode == 1, proc.text()[-9000:]  # Hydra's exit on an error it reports
    assert "ChildRankError: Child rank 1 failed" in proc.text(), proc.text()[-9000:]
    assert {number: trial["state"] for number, trial in trials.items()} == {0: "COMPLETE", 1: "FAIL"}
    assert_trained_and_returned(app, trials[0])  # the failing trial's batch ran whole
    assert not (app / "sweep" / "2").exists() and not (app / "sweep" / "optimization_results.yaml").exists()
