"""The routed-expert sum written once for numpy and CuPy (workers.moe.grouped_expert_sum:
numpy here, CuPy in workers/cuda_model.py) against the reference workers.moe.expert_sum bit
for bit on hostile routing."""
from __future__ import annotations

import numpy as np
import pytest

from workers.moe import expert_sum, gated_mlp, grouped_expert_sum


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


@pytest.mark.parametrize("seed", range(6))
def test_grouped_sum_equals_expert_sum_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    E, H, I, N, k = 9, 48 + seed, 24 + 3 * seed, 23, 4
    gate, up, down = stacks(rng, E, H, I)
    x = activations(rng, N, H)
    idx, w = hostile_routing(rng, N, E, k)
    ref = expert_sum(x, idx, w, gate, up, down)
    got = grouped_expert_sum(x, idx, w, lambda e, r: gated_mlp(r, gate[e], up[e], down[e]))
    assert got.dtype == np.float32 and got.shape == (N, H)
    np.testing.assert_array_equal(bits(got), bits(ref))
    assert not got[1].any()  # every pick -1: zeros
    assert np.isnan(got[2]).all() == (idx[2] >= 0).any()
    assert np.isfinite(np.delete(got, 2, axis=0)).all()


def test_grouped_sum_edge_batches():
    """No pick at all, one token, a token picking every expert: still expert_sum's bits."""
    rng = np.random.default_rng(11)
    E, H, I = 5, 16, 8
    gate, up, down = stacks(rng, E, H, I)
    mlp = lambda e, r: gated_mlp(r, gate[e], up[e], down[e])  # noqa: E731
    x = rng.standard_normal((3, H)).astype(np.float32)
    none = np.full((3, 2), -1)
    out = grouped_expert_sum(x, none, np.ones((3, 2), np.float32), mlp)
    np.testing.assert_array_equal(bits(out), bits(np.zeros_like(x)))
    for idx in (np.array([[3, 0]]), np.array([rng.permutation(E)] * 3)):
        n = len(idx)
        w = rng.standard_normal(idx.shape).astype(np.float32)
        np.testing.assert_array_equal(bits(grouped_expert_sum(x[:n], idx, w, mlp)),
                                      bits(expert_sum(x[:n], idx, w, gate, up, down)))
