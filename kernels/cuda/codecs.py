"""GPU row encoders (CuPy): the same bytes as kernels/cpu/codecs.encode_rows, on the device.

    encode_rows(tier, x[..., n] float32 cupy) -> (codes[..., code_width(n)], scales[...])

kv8 and tq4 run kernels from codecs.cu (bit-exact with the numpy reference: compiled with
--fmad=false, explicit round-to-nearest intrinsics in the contract's order); f32 is a copy
with unit scales. polar has no CUDA encoder: `has_encoder(tier)` is False and callers fall
back to the CPU codec (kvstore/device_pool.py counts and logs that).
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from kernels.cpu.rotation import rotatable
from kernels.cuda._build import kernel
from kernels.tiers import Tier, TierError, get_tier

THREADS = 256  # codecs.cu THREADS


def has_encoder(tier: Tier | str) -> bool:
    return get_tier(tier).kind in ("f32", "fp8", "tq")


def _rows(x, n_what: str) -> cp.ndarray:
    if not isinstance(x, cp.ndarray):
        raise TypeError(f"{n_what} must be a cupy array, got {type(x).__name__}")
    if x.dtype != cp.float32:
        raise TypeError(f"{n_what} must be float32, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] <= 0:
        raise TierError(f"{n_what} must have a non-empty row axis, got shape {x.shape}")
    return cp.ascontiguousarray(x).reshape(-1, x.shape[-1])


def _inv_sqrt(n: int) -> tuple[np.float32, np.float32]:
    sq = np.sqrt(np.float32(n))  # the reference's float32 sqrtf(n) and 1.0f / sqrtf(n)
    return sq, np.float32(1.0) / sq


def encode_rows(tier: Tier | str, x: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """Encode float32 rows x[..., n] on the device; see the module docstring."""
    tier = get_tier(tier)
    rows = _rows(x, "x")
    lead, n = x.shape[:-1], x.shape[-1]
    width = tier.code_width(n)  # raises TierError for widths the tier cannot hold
    R = rows.shape[0]
    if tier.kind == "f32":
        codes, scales = rows.copy(), cp.ones(R, cp.float32)
    elif tier.kind == "fp8":
        codes = cp.empty((R, n), cp.uint8)
        scales = cp.empty(R, cp.float32)
        if R:
            kernel("codecs.cu", "fp8_encode", exact=True)(
                (R,), (THREADS,), (rows, codes, scales, np.int32(n)))
    elif tier.kind == "tq":
        codes = cp.zeros((R, n // 2), cp.uint8)
        scales = cp.zeros(R, cp.float32)
        if R and rotatable(n):  # other widths are inert: zero codes, zero radius
            sq, inv = _inv_sqrt(n)
            kernel("codecs.cu", "tq4_encode", exact=True)(
                (R,), (THREADS,), (rows, codes, scales, np.int32(n), sq, inv),
                shared_mem=4 * n)
    else:
        raise TierError(f"{tier.name}: no CUDA encoder for kind {tier.kind!r} "
                        f"(check has_encoder() and use the CPU codec)")
    return codes.reshape(*lead, width), scales.reshape(lead)


def rotate_rows(x: cp.ndarray) -> cp.ndarray:
    """y = H(D x) on the last axis (float32, the reference's rotate() bit for bit)."""
    rows = _rows(x, "x")
    n = x.shape[-1]
    if not rotatable(n):
        raise ValueError(f"rotation width {n=} must be a power of two in 2..2048")
    y = cp.empty_like(rows)
    if rows.shape[0]:
        _, inv = _inv_sqrt(n)
        kernel("codecs.cu", "rotate_rows", exact=True)(
            (rows.shape[0],), (THREADS,), (rows, y, np.int32(n), inv), shared_mem=4 * n)
    return y.reshape(x.shape)
