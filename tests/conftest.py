import pytest
from helpers import copy_app


@pytest.fixture
def app(tmp_path):
    """A directory holding the sweep app (app.py) and a module next to it (shapes.py)."""
    return copy_app(tmp_path)
