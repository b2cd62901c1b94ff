"""Next-token sampling for a batch of rows: greedy, or temperature with top-p (nucleus).

Stateless per row: the uniform draw of a row comes from its request's seed and the index of
the token being chosen (splitmix64), not from a shared generator, so a token does not depend
on which other rows share the batch, and a re-run (after a worker death) draws the same.
temperature 0 means greedy (argmax; ties pick the lowest id).
"""
from __future__ import annotations

import numpy as np


def _uniform(seed: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """A float64 in [0, 1) per row from splitmix64(seed * golden + counter)."""
    with np.errstate(over="ignore"):
        x = seed.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + counter.astype(np.uint64)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def sample_rows(logits: np.ndarray, temperature: np.ndarray, top_p: np.ndarray,
                seed: np.ndarray, counter: np.ndarray) -> np.ndarray:
    """Next token per row of logits [M, V]: argmax where temperature is 0, else a nucleus
    (top_p) draw from softmax(logits / T) with the row's own (seed, counter) uniform."""
    logits = np.asarray(logits, np.float32)
    out = np.argmax(logits, axis=-1).astype(np.int32)
    hot = np.flatnonzero(np.asarray(temperature) > 0)
    if hot.size == 0:
        return out
    z = logits[hot].astype(np.float64) / np.asarray(temperature, np.float64)[hot, None]
    order = np.argsort(-z, axis=-1, kind="stable")  # [m, V] most likely first
    zs = np.take_along_axis(z, order, axis=-1)
    p = np.exp(zs - zs[:, :1])
    p /= p.sum(axis=-1, keepdims=True)
    before = np.cumsum(p, axis=-1) - p  # mass of the more likely tokens
    keep = before < np.asarray(top_p, np.float64)[hot, None]
    keep[:, 0] = True  # the most likely token, also where top_p is 0 (a tiny one as float32)
    p = np.where(keep, p, 0.0)
    cdf = np.cumsum(p, axis=-1)
    u = _uniform(np.asarray(seed)[hot], np.asarray(counter)[hot]) * cdf[:, -1]
    pick = np.minimum((cdf <= u[:, None]).sum(axis=-1), p.shape[1] - 1)
    out[hot] = order[np.arange(hot.size), pick]
    return out
