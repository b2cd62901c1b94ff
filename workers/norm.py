"""RMSNorm and SiLU on float32 numpy (the two elementwise pieces every layer shares)."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis, in float32 (as transformers)."""
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written with tanh so that large |x| cannot overflow exp."""
    return x * sigmoid(x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x))
