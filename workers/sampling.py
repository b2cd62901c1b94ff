"""Next-token sampling over a batch of logits rows: greedy, temperature, top-k, top-p.

Randomness comes only from the numpy Generator passed in (seed it for reproducible runs).
temperature 0 means greedy (argmax; ties pick the lowest id).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.top_k < 0 or self.max_tokens < 0:
            raise ValueError(f"top_k={self.top_k!r} and max_tokens={self.max_tokens!r} must be >= 0")

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution [B, V] (float64) that `sample` draws from, after temperature/top-k/top-p."""
    z = np.asarray(logits, np.float64) / params.temperature
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    ps = np.take_along_axis(p, order, axis=-1)
    keep = np.ones_like(ps, bool)
    if params.top_k:
        keep[:, params.top_k:] = False
    if params.top_p < 1:
        before = np.cumsum(ps, axis=-1) - ps  # mass of strictly better tokens
        keep &= before < params.top_p  # the best token always stays
    ps = np.where(keep, ps, 0.0)
    out = np.zeros_like(p)
    np.put_along_axis(out, order, ps / ps.sum(axis=-1, keepdims=True), axis=-1)
    return out


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> np.ndarray:
    """Token ids [B] for logits [B, V]."""
    logits = np.atleast_2d(logits)
    if params.temperature == 0:
        return np.argmax(logits, axis=-1)
    p = probabilities(logits, params)
    cdf = np.cumsum(p, axis=-1)
    u = rng.random(len(p))[:, None] * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=-1), p.shape[1] - 1)
