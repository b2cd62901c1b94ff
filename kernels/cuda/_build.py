"""Lazy NVRTC compilation of the .cu sources beside this file, cached by their parameters.

    fn = kernel("attention.cu", "attn_split", TIER=1, MT=4)   # compiled once per parameter set

Parameters become -D defines, so one source yields one specialised module per tier / tile
shape (mini-sglang's `_jit_*_module` idea). The cache is keyed on (source, defines, device)
and lives for the process; compilation happens on first use, never at import.
"""
from __future__ import annotations

import functools
import os

import cupy as cp

_HERE = os.path.dirname(os.path.abspath(__file__))

# Bit-exact float32: no fused multiply-add, IEEE division and square root, denormals kept.
EXACT_OPTIONS = ("--std=c++17", "--fmad=false", "--prec-div=true", "--prec-sqrt=true",
                 "--ftz=false")
FAST_OPTIONS = ("--std=c++17",)


@functools.lru_cache(maxsize=None)
def _source(name: str) -> str:
    with open(os.path.join(_HERE, name), encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def _module(name: str, defines: tuple[tuple[str, int], ...], exact: bool,
            device: int) -> cp.RawModule:
    opts = (EXACT_OPTIONS if exact else FAST_OPTIONS) + tuple(
        f"-D{k}={v}" for k, v in defines)
    if os.environ.get("KVFLEET_CUDA_LINEINFO") == "1":  # source lines for ncu / profilers
        opts += ("--generate-line-info",)
    mod = cp.RawModule(code=_source(name), options=opts)
    mod.compile()
    return mod


def kernel(name: str, func: str, exact: bool = False, **defines: int) -> cp.RawKernel:
    """The compiled function `func` of kernels/cuda/`name` with `defines` as -D macros."""
    key = tuple(sorted((k, int(v)) for k, v in defines.items()))
    return _module(name, key, exact, cp.cuda.Device().id).get_function(func)


def cuda_available() -> bool:
    """True when cupy can see at least one CUDA device."""
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except cp.cuda.runtime.CUDARuntimeError:
        return False
