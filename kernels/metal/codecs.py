"""Row codecs of every KV tier on MLX arrays, the same interface as kernels/cpu/codecs.py:

    encode_rows(tier, x[..., n])          -> (codes[..., code_width(n)], scales[...] f32)
    decode_rows(tier, codes, scales, n)   -> f32[..., n]

f32, kv8 and tq4 run as MLX ops (kernels/metal/fp8.py, tq4.py) and are bit-identical to the
numpy reference. The polar tiers have no MLX codec yet: they go through the numpy codec
(a copy through host memory; on a Mac that memory is the GPU's too) and are counted as
fallbacks in the `stats` object when one is given.
"""
from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from kernels.cpu import codecs as cpu_codecs
from kernels.metal import fp8, tq4
from kernels.metal.backend import KernelStats
from kernels.tiers import Tier, TierError, get_tier


def as_mx(a) -> mx.array:
    """An mx array of `a` (mx, numpy or a list). numpy views with negative strides (x[::-1])
    are copied first: mx.array refuses them."""
    if isinstance(a, mx.array):
        return a
    return mx.array(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a)


def encode_rows(tier: Tier | str, x, stats: KernelStats | None = None
                ) -> tuple[mx.array, mx.array]:
    """Encode float32 rows x[..., n] (mx or numpy) with the tier's codec."""
    tier = get_tier(tier)
    x = as_mx(x)
    x = x.astype(mx.float32)
    if x.ndim < 1:
        raise TierError(f"{tier.name}: x must have a row axis, got shape {x.shape}")
    lead, n = x.shape[:-1], x.shape[-1]
    width = tier.code_width(n)  # raises TierError for widths the tier cannot hold
    rows = x.reshape(-1, n)
    if tier.kind == "f32":
        codes, scales = rows, mx.ones((rows.shape[0],), mx.float32)
    elif tier.kind == "fp8":
        codes, scales = fp8.encode(rows)
    elif tier.kind == "tq":
        codes, scales = tq4.encode(rows)
    else:
        if stats is not None:
            stats.count_fallback(f"encode_{tier.name}", "no MLX codec; numpy encode",
                                 logging.WARNING)
        c, s = cpu_codecs.encode_rows(tier, np.array(rows))
        codes, scales = mx.array(c), mx.array(s)
    return codes.reshape(*lead, width), scales.reshape(lead)


def decode_rows(tier: Tier | str, codes, scales, n: int,
                stats: KernelStats | None = None) -> mx.array:
    """Decode codes[..., code_width(n)] with scales[...] to float32 rows [..., n]."""
    tier = get_tier(tier)
    width = tier.code_width(n)
    # in the tier's code dtype, by the numpy reference's rule (a cast that would change a
    # value is an error): a gather through wider codes (int64 from a list, 300 or 2^20)
    # read past the 256-entry tables (a segfault)
    dt = mx.float32 if tier.code_dtype() == "float32" else mx.uint8
    if not (isinstance(codes, mx.array) and codes.dtype == dt):
        codes = cpu_codecs.as_codes(tier, np.array(codes))
    codes, scales = as_mx(codes), as_mx(scales).astype(mx.float32)
    lead = tuple(codes.shape[:-1])
    if codes.ndim < 1 or codes.shape[-1] != width or tuple(scales.shape) != lead:
        raise TierError(f"{tier.name}: codes {tuple(codes.shape)} / scales "
                        f"{tuple(scales.shape)} do not match width {width}")
    flat, s = codes.reshape(-1, width), scales.reshape(-1)
    if tier.kind == "f32":
        out = flat.astype(mx.float32)
    elif tier.kind == "fp8":
        out = fp8.decode(flat, s)
    elif tier.kind == "tq":
        out = tq4.decode(flat, s, n)
    else:
        if stats is not None:
            stats.count_fallback(f"decode_{tier.name}", "no MLX codec; numpy decode",
                                 logging.WARNING)
        out = mx.array(cpu_codecs.decode_rows(tier, np.array(flat), np.array(s), n))
    return out.reshape(*lead, n)
