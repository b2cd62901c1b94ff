"""Fixtures shared by the cluster tests."""
import pytest

from runtime_helpers import make_tiny


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The tiny random checkpoint (scripts/make_tiny_model.py), built once per session."""
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ray():
    """A local Ray of 2 CPUs for one test module (never a running cluster)."""
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()
