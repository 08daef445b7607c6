"""What the end-to-end tests skip is decided apart from the code under test: helpers.SHOULD_BUILD says,
from the installed releases alone, which strategies run here (HydraFSDP on the CPU from Lightning 2.3,
HydraModelParallel on the CPU from Lightning 2.4 with torch 2.10). Here hydra_fsdp's own refusal
(``_check_versions``) must agree with it, so that a wrong refusal fails this test, and the tests of that
strategy with it, instead of quietly turning them into skips."""

import pytest
from helpers import SHOULD_BUILD, builds_here


@pytest.mark.parametrize("strategy", sorted(SHOULD_BUILD))
def test_hydra_fsdp_builds_exactly_what_should_build_here(strategy):
    expected = "builds" if SHOULD_BUILD[strategy] else "is refused"
    assert builds_here(strategy) == SHOULD_BUILD[strategy], f"{strategy} should be {expected} here"
