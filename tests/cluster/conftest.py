"""Fixtures shared by the cluster tests."""
import pytest

from runtime_helpers import make_tiny


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny random checkpoint (scripts/make_tiny_model.py), built once per session."""
    return make_tiny(tmp_path_factory.mktemp("tiny"))
