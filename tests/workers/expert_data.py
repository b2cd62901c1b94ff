"""Hostile expert weights, routing and activations, shared by the expert-shard tests on
the host (tests/workers/test_expert_shard.py) and on the GPU (tests/gpu/)."""
from __future__ import annotations

import numpy as np


def stacks(rng, E, H, I):
    """gate, up, down of E experts whose scales differ by orders of magnitude."""
    scale = rng.choice([1e-3, 1.0, 30.0], (E, 1, 1)).astype(np.float32)
    return ((rng.standard_normal((E, I, H)) * scale).astype(np.float32),
            rng.standard_normal((E, I, H)).astype(np.float32),
            rng.standard_normal((E, H, I)).astype(np.float32))


def hostile_routing(rng, N, E, k):
    """idx [N, k] with distinct ids per token in shuffled column order, ragged (-1 picks
    anywhere in a row), token 1 with every pick -1, expert E-1 picked by exactly one token;
    w [N, k] float32 of mixed signs and sizes."""
    idx = np.stack([rng.permutation(E - 1)[:k] for _ in range(N)])
    idx[rng.random((N, k)) < 0.3] = -1
    idx[1] = -1
    idx[N - 1, rng.integers(k)] = E - 1  # (E-1 is in no other row)
    w = (rng.standard_normal((N, k)) * rng.choice([1e-2, 1.0, 50.0], (N, k))).astype(np.float32)
    return idx, w


def activations(rng, N, H):
    """x [N, hidden]: rows of very different sizes and one NaN row (token 2)."""
    x = (rng.standard_normal((N, H)) * rng.choice([1e-4, 1.0, 1e3], (N, 1))).astype(np.float32)
    x[2, 5] = np.nan
    return x


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)
