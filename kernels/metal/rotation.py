"""The tq4/polar rotation y = H(D x) and its inverse x = D H(y) with MLX ops, bit-identical
to kernels/cpu/rotation.py (DESIGN.md "KV tiers").

Every step is a float32 multiply by +-1, an elementwise add or subtract, or the one multiply
by float32(1)/sqrtf(n) at the end (computed on the host in numpy float32, so the constant is
the same bits on every backend). The butterfly stages are separate MLX ops in the contract's
order; nothing here is wrapped in mx.compile, because a fused kernel may contract or
reassociate float ops, and these results are part of the byte contract.
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


def hadamard(a: mx.array) -> mx.array:
    """H on the last axis: radix-2 butterfly stages len = 1, 2, ..., n/2, then * 1/sqrt(n)."""
    n = a.shape[-1]
    if not ref.rotatable(n):
        raise ValueError(f"rotation width {n=} must be a power of two in 2..{ref.MAX_WIDTH}")
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
    if not ref.rotatable(n):
        raise ValueError(f"rotation width {n=} must be a power of two in 2..{ref.MAX_WIDTH}")
    return hadamard(x.astype(mx.float32) * _constants(n)[0])


def unrotate(y: mx.array) -> mx.array:
    """x = D H(y) on the last axis (float32)."""
    return hadamard(y.astype(mx.float32)) * _constants(y.shape[-1])[0]


def rotate_fast(x: mx.array) -> mx.array:
    """rotate() through MLX's own Walsh-Hadamard kernel, for the attention consumers only:
    the same transform, but its add order is MLX's (equal bits on the CPU backend in our
    tests, not promised on Metal), so codes are never computed with it."""
    n = x.shape[-1]
    return mx.hadamard_transform(x.astype(mx.float32) * _constants(n)[0], scale=_constants(n)[1])


def unrotate_fast(y: mx.array) -> mx.array:
    """unrotate() through MLX's Walsh-Hadamard kernel (consumers only; see rotate_fast)."""
    n = y.shape[-1]
    return mx.hadamard_transform(y.astype(mx.float32), scale=_constants(n)[1]) * _constants(n)[0]
