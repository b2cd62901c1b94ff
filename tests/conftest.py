"""Shared fixtures for every test folder."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

# modules that import cupy at their top: imported afresh over the stand-in, removed after
CUDA_MODULES = ("kernels.cuda._build", "kernels.cuda.codecs", "kernels.cuda.attention",
                "kvstore.device_pool")


class _DeviceArray(np.ndarray):
    """A numpy array that passes isinstance(a, cupy.ndarray): .get(), .data.ptr."""

    def get(self):
        return np.array(self)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _fake_cupy(cc: str, per_sm: int, optin: int, sms: int) -> types.ModuleType:
    cp = types.ModuleType("cupy")
    dev = lambda a: np.array(a).view(_DeviceArray)  # noqa: E731
    cp.ndarray = _DeviceArray
    for name in ("float32", "float16", "int32", "int64", "uint8", "uint16", "uint32"):
        setattr(cp, name, getattr(np, name))
    cp.asarray = lambda a, dtype=None: dev(np.asarray(a, dtype))
    cp.ascontiguousarray = lambda a, dtype=None: dev(np.ascontiguousarray(a, dtype))
    for name in ("full", "empty", "zeros", "ones", "where"):
        setattr(cp, name, (lambda f: lambda *a, **k: dev(f(*a, **k)))(getattr(np, name)))
    attrs = {"MaxSharedMemoryPerMultiprocessor": per_sm, "MaxSharedMemoryPerBlockOptin": optin,
             "MultiProcessorCount": sms}
    cp.cuda = types.SimpleNamespace(
        Device=lambda i=0: types.SimpleNamespace(id=i, compute_capability=cc, attributes=attrs),
        get_current_stream=lambda: types.SimpleNamespace(ptr=0),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, CUDARuntimeError=RuntimeError))
    return cp


@pytest.fixture
def fake_cupy(monkeypatch):
    """use(cc="90", per_sm=, optin=, sms=) -> cupy stand-in (numpy arrays, one device with
    an H200's limits by default) with kernels.cuda.* and kvstore.device_pool imported over
    it, for their host-side logic (plans, checks, caches, counters; no kernel runs). The
    real modules and cupy's absence come back after the test."""
    import importlib

    import kernels.cuda
    import kvstore

    def use(cc: str = "90", per_sm: int = 233472, optin: int = 232448, sms: int = 132):
        monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(cc, per_sm, optin, sms))
        for name in CUDA_MODULES:
            monkeypatch.setitem(sys.modules, name, None)  # (undo: restored or removed)
            del sys.modules[name]
            pkg, _, attr = name.rpartition(".")
            monkeypatch.setattr({"kernels.cuda": kernels.cuda, "kvstore": kvstore}[pkg], attr,
                                None, raising=False)
        for name in CUDA_MODULES:
            importlib.import_module(name)
        return sys.modules["cupy"]

    return use
