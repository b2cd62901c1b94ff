"""Rotary position embedding for the qk_rope_head_dim part of MLA, with YaRN scaling.

Follows the transformers DeepseekV3 implementation: inverse frequencies and angles are
computed in float32, cos/sin are multiplied by YaRN's attention factor, and the softmax
scale gains mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set.

Layouts (both rotate pair i by angle pos * inv_freq[i]):
  rope_interleave=True   pairs are (x[2i], x[2i+1]) (DeepSeek's reference); the output keeps
                         that interleaved layout (transformers returns the pairs de-interleaved,
                         which permutes q and k alike and so gives the same scores).
  rope_interleave=False  pairs are (x[i], x[i + d/2]) (rotate_half).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from workers.config import ModelConfig, RopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, ys: RopeScaling) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] f32, cos/sin attention factor) for YaRN."""
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extra = np.float32(1.0) / pos_freqs
    inter = np.float32(1.0) / (np.float32(ys.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(ys.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(ys.beta_fast), correction_dim(ys.beta_slow)
    if ys.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra_factor = np.float32(1.0) - ramp.astype(np.float32)
    inv_freq = inter * (np.float32(1.0) - extra_factor) + extra * extra_factor
    if ys.attention_factor is not None:
        att = ys.attention_factor
    elif ys.mscale and ys.mscale_all_dim:  # both set and non-zero, else plain mscale(factor)
        att = _yarn_mscale(ys.factor, ys.mscale) / _yarn_mscale(ys.factor, ys.mscale_all_dim)
    else:
        att = _yarn_mscale(ys.factor)
    return inv_freq.astype(np.float32), float(att)


@dataclass(frozen=True)
class Rope:
    inv_freq: np.ndarray  # [d/2] f32
    attention_factor: float  # multiplies cos and sin
    interleave: bool
    softmax_scale: float  # 1/sqrt(qk_head_dim), YaRN-corrected

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "Rope":
        dim = cfg.qk_rope_head_dim
        scale = cfg.qk_head_dim ** -0.5
        ys = cfg.rope_scaling
        if ys is None:
            inv = np.float32(1.0) / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
            return cls(inv.astype(np.float32), 1.0, cfg.rope_interleave, scale)
        inv, att = _yarn_inv_freq(dim, cfg.rope_theta, ys)
        if ys.mscale_all_dim:
            m = _yarn_mscale(ys.factor, ys.mscale_all_dim)
            scale = scale * m * m
        return cls(inv, att, cfg.rope_interleave, scale)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [N, d/2] f32 for integer positions [N]."""
        ang = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        f = np.float32(self.attention_factor)
        return (np.cos(ang) * f).astype(np.float32), (np.sin(ang) * f).astype(np.float32)

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x [N, ..., d] with cos/sin [N, d/2] (broadcast over the middle axes)."""
        extra = x.ndim - 2
        c = cos.reshape(cos.shape[0], *([1] * extra), cos.shape[1])
        s = sin.reshape(sin.shape[0], *([1] * extra), sin.shape[1])
        out = np.empty_like(x)
        if self.interleave:
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2] = a * c - b * s
            out[..., 1::2] = b * c + a * s
        else:
            h = x.shape[-1] // 2
            a, b = x[..., :h], x[..., h:]
            out[..., :h] = a * c - b * s
            out[..., h:] = b * c + a * s
        return out
