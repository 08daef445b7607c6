"""The README's own code blocks, run as a user would paste them: the hydra-zen train.py as a file of
its own; the YAML trainer config goes into the
lightning-hydra-template-shaped app's sweep (tests/test_template.py); and the example sweep, run with
the command the README shows, prints what the README says it prints. A README that drifts from the
code fails here."""

import re
import sys
from pathlib import Path

import pytest
from helpers import app_env, builds_here, ok, run

README = Path(__file__).parent.parent / "README.md"
EXAMPLE = README.parent / "example_sweep.py"
# what example_sweep.py's rank 0 prints for each rank of each job
REPORT = re.compile(
    r"^job (?P<job>\d+): lr=(?P<lr>[\d.]+), (?P<strategy>\w+), rank (?P<rank>\d)/2 \(pid (?P<pid>\d+)\)"
    r" holds (?P<held>\d+) of (?P<total>\d+) parameters, loss (?P<loss>[\d.]+)$",
    flags=re.MULTILINE,
)
EXAMPLE_STRATEGIES = {"ddp": "HydraDDP", "fsdp": "HydraFSDP", "model_parallel": "HydraModelParallel"}


def blocks(language):
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_the_readme_has_the_blocks_this_file_runs():
    assert len(blocks("yaml")) == 1 and len(blocks("python")) == 1
    assert len(README.read_bytes()) <= 12_000, "the README stays under 12,000 bytes: the rest is in docs/"


@pytest.mark.fsdp_cpu
def test_readme_hydra_zen_train_py_sweeps(tmp_path):
    train_py = next(block for block in blocks("python") if "zen(train)" in block)
    (tmp_path / "train.py").write_text(train_py)
    proc = ok(run([sys.executable, "train.py", "-m", "trainer.max_epochs=1,2", "hydra.sweep.dir=sweep"],
                  tmp_path, app_env()))  # fmt: skip
    restored = "Restoring states from the checkpoint path at"  # test(ckpt_path="best") loaded it
    assert proc.text().count(restored) == 2, proc.text()[-3000:]
    for job in ("0", "1"):
        log = (tmp_path / "sweep" / job / "rank_1.log").read_text()
        assert "GLOBAL_RANK: 1" in log and "Traceback" not in log, log[-3000:]
        overrides = (tmp_path / "sweep" / job / ".hydra" / "overrides.yaml").read_text()
        assert f"trainer.max_epochs={int(job) + 1}" in overrides


def test_example_sweep_prints_every_rank_and_one_loss_per_lr(tmp_path):
    """The README's command for the example, with the strategies that build here (all three on today's
    stack): a line for every rank of every job, each from a process of its own (rank 0 the sweep), the
    parameters held as each strategy holds them, and one loss per lr whatever the strategy."""
    command = "python example_sweep.py -m trainer/strategy=ddp,fsdp,model_parallel"
    assert f"`{command}`" in README.read_text()
    shown = [match.groupdict() for match in REPORT.finditer(README.read_text())]
    assert len(shown) >= 6 and {line["strategy"] for line in shown} == set(EXAMPLE_STRATEGIES.values())
    swept = [name for name, strategy in EXAMPLE_STRATEGIES.items() if builds_here(strategy)]
    proc = ok(run([sys.executable, str(EXAMPLE), "-m", f"trainer/strategy={','.join(swept)}",
                   "hydra.sweep.dir=sweep"], tmp_path, app_env()))  # fmt: skip
    reports = [match.groupdict() for match in REPORT.finditer(proc.text())]
    jobs = {int(report["job"]) for report in reports}
    assert jobs == set(range(2 * len(swept))) and len(reports) == 2 * len(jobs), proc.text()[-6000:]
    children = [report["pid"] for report in reports if report["rank"] == "1"]
    assert {report["pid"] for report in reports if report["rank"] == "0"} == {str(proc.pid)}
    assert len(set(children)) == len(jobs) and str(proc.pid) not in children  # a fresh child per job
    for job in jobs:
        ranks = [report for report in reports if int(report["job"]) == job]
        held, total = [int(rank["held"]) for rank in ranks], int(ranks[0]["total"])
        if ranks[0]["strategy"] == "HydraDDP":
            assert held == [total, total], ranks
        else:  # sharded: each rank its part, the parts the whole
            assert sum(held) == total and 0 < min(held), ranks
    losses = {(report["lr"], report["loss"]) for report in reports}
    assert sorted(lr for lr, _ in losses) == ["0.01", "0.05"], (
        f"one loss per lr, whatever the strategy: {losses}"
    )
