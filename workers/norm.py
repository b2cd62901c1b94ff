"""RMSNorm and SiLU on float32 numpy (the two elementwise pieces every layer shares)."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis, in float32 (as transformers)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), with the sigmoid written with tanh (no exp to overflow, float32
    throughout, the form the CUDA and MLX kernels use); where it cancels (x below ~ -8) x * it
    is below 1e-3 in any case. The router's scores take `sigmoid`."""
    return x * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x)))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) in x's float dtype, rounded from float64 (within 1 float32 ulp).

    exp only ever sees -|x| <= 0, so it cannot overflow; for x < 0 the result is e / (1 + e)
    with e = exp(x), which keeps the relative accuracy of tiny router scores (the tanh form
    0.5 * (1 + tanh(x / 2)) cancels there and is exactly 0 below x ~ -17 in float32)."""
    x = np.asarray(x)
    e = np.exp(-np.abs(x, dtype=np.float64))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype)
