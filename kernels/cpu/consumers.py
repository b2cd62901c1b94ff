"""Native CPU consumers of a coded KV row plane: scores and contexts straight from the codes.

Both functions take an optional batch of independent rows (leading axis B): every slot of
a ragged decode step is one b, with its own keys.

    scores(tier, q[B, M, n], codes[B, T, w], scales[B, T])     -> [B, M, T]   q . row_t
    context(tier, p[B, M, T], codes[B, T, w], scales[B, T], n) -> [B, M, n]   sum_t p_t row_t

`row_t` is what `kernels.cpu.codecs.decode_rows` would return for (codes[b, t], scales[b, t]);
the consumers must equal decode-then-multiply within float32 rounding but never build the
decoded f32 rows of the cache (the per-tier tricks are documented beside each function).
Callers pass codes that are safe to read: positions that are masked out carry code 0 and
scale 0, never garbage.
"""
from __future__ import annotations

import numpy as np

from kernels.tiers import Tier


def _f32_scores(q: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return np.matmul(q, codes.swapaxes(-1, -2))


def _f32_context(p: np.ndarray, codes: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    return np.matmul(p, codes)


# kind -> (scores, context); the quantized kinds register theirs below.
_CONSUMERS = {"f32": (_f32_scores, _f32_context)}


def scores(tier: Tier, q: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """q[..., M, n] against the coded rows [..., T, w] -> [..., M, T] float32."""
    return _CONSUMERS[tier.kind][0](q, codes, scales)


def context(tier: Tier, p: np.ndarray, codes: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    """Weights p[..., M, T] times the coded rows [..., T, w] -> [..., M, n] float32."""
    return _CONSUMERS[tier.kind][1](p, codes, scales, n)
