"""The README's own code blocks, run as a user would paste them: the hydra-zen train.py as a file of
its own, the DeepSpeed wrapper as Python; the YAML trainer config goes into the
lightning-hydra-template-shaped app's sweep (tests/test_template.py). A README that drifts from the
code fails here."""

import inspect
import re
import sys
from pathlib import Path

import pytest
from helpers import app_env, ok, run

import hydra_fsdp

README = Path(__file__).parent.parent / "README.md"


def blocks(language):
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_the_readme_has_the_blocks_this_file_runs():
    assert len(blocks("yaml")) == 1 and len(blocks("python")) == 2
    assert len(README.read_bytes()) <= 12 * 1024, "the README stays under 12 KB: the rest is in docs/"


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


def test_readme_deepspeed_wrapper_defines_a_strategy():
    """Only defined: DeepSpeed itself is not installed here."""
    wrapper = next(block for block in blocks("python") if "DeepSpeedStrategy" in block)
    scope = {}
    exec(compile(wrapper, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    strategy_class = scope["HydraDeepSpeed"]
    assert issubclass(strategy_class, sys.modules["pytorch_lightning.strategies"].DeepSpeedStrategy)
    assert (
        inspect.getattr_static(strategy_class, "launcher") is hydra_fsdp._HydraStrategy.__dict__["launcher"]
    )
