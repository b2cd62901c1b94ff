"""The tq4/polar rotation y = H(D x) and its inverse x = D H(y) with MLX ops, bit-identical
to kernels/cpu/rotation.py (DESIGN.md "KV tiers").

`butterfly` is the contract written as MLX ops: a float32 multiply by +-1, the radix-2
stages (len = 1, 2, ..., n/2) as separate elementwise adds and subtracts, then one multiply
by float32(1)/sqrtf(n) (computed on the host in numpy float32). Not wrapped in mx.compile:
a fused kernel could contract or reassociate float ops.

MLX's own mx.hadamard_transform is the same transform in one kernel, about 10x faster, but
its add order is MLX's business. So `hadamard` uses it only where it was seen to give the
butterfly's bits: once per (width, device) it transforms 65,536 values of wide dynamic
range both ways and compares every bit (a different add order would differ on a large share
of them); otherwise it runs the butterfly. On the Linux CPU backend they agree; on Metal the
check decides at first use.
"""
from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from kernels.cpu import rotation as ref


@lru_cache(maxsize=None)
def _constants(n: int) -> tuple[mx.array, float]:
    inv_sqrt_n = float(np.float32(1.0) / np.sqrt(np.float32(n)))  # exact in float32
    return mx.array(ref.signs(n)), inv_sqrt_n


def _check(n: int) -> None:
    if not ref.rotatable(n):
        raise ValueError(f"rotation width {n=} must be a power of two in 2..{ref.MAX_WIDTH}")


@lru_cache(maxsize=None)
def _native_is_exact(n: int, device: str) -> bool:
    """Does mx.hadamard_transform give the butterfly's bits at width n on `device`?"""
    rng = np.random.default_rng(n)
    rows = max(1, 65536 // n)
    x = rng.standard_normal((rows, n)) * np.exp(rng.uniform(-30, 30, (rows, 1)))
    a = mx.array(x.astype(np.float32))
    fast = np.array(mx.hadamard_transform(a, scale=_constants(n)[1]))
    return bool(np.array_equal(fast.view(np.uint32), np.array(butterfly(a)).view(np.uint32)))


def _wht(a: mx.array, n: int) -> mx.array:
    """mx.hadamard_transform scaled by 1/sqrt(n); it refuses empty arrays (a write or a
    batch of zero rows), which have nothing to transform."""
    a = a.astype(mx.float32)
    return a if a.size == 0 else mx.hadamard_transform(a, scale=_constants(n)[1])


def hadamard(a: mx.array) -> mx.array:
    """H on the last axis, bit-identical to the contract's butterfly (see the module doc)."""
    n = a.shape[-1]
    _check(n)
    if _native_is_exact(n, str(mx.default_device())):
        return _wht(a, n)
    return butterfly(a)


def butterfly(a: mx.array) -> mx.array:
    """H as the contract writes it: radix-2 stages len = 1, 2, ..., n/2, then * 1/sqrt(n)."""
    n = a.shape[-1]
    _check(n)
    lead = a.shape[:-1]
    h = 1
    while h < n:
        v = a.reshape(*lead, n // (2 * h), 2, h)
        lo, hi = v[..., 0:1, :], v[..., 1:2, :]
        a = mx.concatenate([lo + hi, lo - hi], axis=-2).reshape(*lead, n)
        h *= 2
    return a * mx.array(_constants(n)[1], dtype=mx.float32)


def rotate(x: mx.array) -> mx.array:
    """y = H(D x) on the last axis (float32)."""
    n = x.shape[-1]
    _check(n)
    return hadamard(x.astype(mx.float32) * _constants(n)[0])


def unrotate(y: mx.array) -> mx.array:
    """x = D H(y) on the last axis (float32)."""
    return hadamard(y.astype(mx.float32)) * _constants(y.shape[-1])[0]


def rotate_fast(x: mx.array) -> mx.array:
    """rotate() through MLX's own Walsh-Hadamard kernel, for the attention consumers only:
    the same transform, but its add order is MLX's (equal bits on the CPU backend in our
    tests, not promised on Metal), so codes are never computed with it."""
    n = x.shape[-1]
    return _wht(x.astype(mx.float32) * _constants(n)[0], n)


def unrotate_fast(y: mx.array) -> mx.array:
    """unrotate() through MLX's Walsh-Hadamard kernel (consumers only; see rotate_fast)."""
    n = y.shape[-1]
    return _wht(y, n) * _constants(n)[0]
