"""Shared fixtures: tiny checkpoints built once per session (one per variant combination)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def maker():
    """The scripts/make_tiny_model.py module (the repo root is on pytest's pythonpath)."""
    import scripts.make_tiny_model
    return scripts.make_tiny_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, maker):
    """tiny(*variants, seed=0) -> Path of a checkpoint dir, built once per combination."""
    built: dict[tuple, Path] = {}

    def get(*variants: str, seed: int = 0) -> Path:
        key = (tuple(sorted(variants)), seed)
        if key not in built:
            name = "tiny-" + ("-".join(key[0]) or "base") + f"-s{seed}"
            built[key] = maker.make_tiny_model(tmp_path_factory.mktemp(name), seed, key[0])
        return built[key]

    return get
