"""Shared fixtures: tiny checkpoints built once per session (one per variant combination)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_maker():
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "scripts" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def maker():
    return _load_maker()


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
