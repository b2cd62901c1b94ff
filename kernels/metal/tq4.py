"""tq4 (rotated int4, TurboQuant MSE) row codec with MLX ops, bit-identical to
kernels/cpu/tq4.py (contract: DESIGN.md "KV tiers" and that module's docstring).

The row norm is float32(sqrt(sum of x_i^2 accumulated in float64, left to right)). Metal has
no float64, and a different summation order can move the float32 norm by one ulp on a few
rows in ten million, so the norm is not computed on the GPU: `row_norms` runs on MLX's CPU
stream (mx.cpu, on every machine) as a float64 cumulative sum -- a sequential scan, the
contract's loop order -- and the per-row divide sqrtf(n)/norm runs there too (correctly
rounded IEEE division). On a Mac the CPU stream reads the same unified memory, so this costs
one pass over the rows on the CPU, no copy. Everything else (rotation, nearest level,
nibble packing) is float32 multiply/add/compare and integer ops on the compute device.
The nearest level is a count of float32 thresholds passed (exact: see _thresholds): compares
and integer adds only, fused with mx.compile on the GPU; the scaling stays a separate op.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels.cpu import tq4 as ref
from kernels.cpu.rotation import rotatable
from kernels.metal.rotation import rotate, unrotate

_PAIR_LEVELS = mx.array(ref.PAIR_LEVELS)  # [256, 2]: levels of a byte, low nibble first


def row_norms(x: mx.array) -> mx.array:
    """x[R, n] float32 -> float32 norms per row (float64 sequential sum on the CPU stream)."""
    x64 = x.astype(mx.float64, stream=mx.cpu)
    acc = mx.cumsum(mx.multiply(x64, x64, stream=mx.cpu), axis=-1, stream=mx.cpu)
    return mx.sqrt(acc[:, -1], stream=mx.cpu).astype(mx.float32, stream=mx.cpu)


def _ordinal(f: np.float32) -> int:
    """float32 -> integer with the same order (negative floats mirrored below zero)."""
    b = int(np.array([f], np.float32).view(np.int32)[0])
    return -(b & 0x7FFFFFFF) if b < 0 else b


def _from_ordinal(o: int) -> np.float32:
    b = o if o >= 0 else (-o) | 0x80000000
    return np.array([b], np.uint32).view(np.float32)[0]


def _thresholds() -> np.ndarray:
    """t[k] = the least float32 v with |v - L[k+1]| < |v - L[k]| (float32 distances), found by
    bisection on the float32 order between L[k] and L[k+1]. Within that bracket the test is
    monotone (fl(v - L[k]) never decreases, fl(L[k+1] - v) never increases), so for every
    finite v the contract's scan gives code = #{k : v >= t[k]} -- except far above L[15],
    where fl(v - 2.733) and fl(v - 2.069) round to the same float and the tie keeps index
    14: that happens exactly from _TIE_ABOVE on (checked exhaustively over [2^22, 2^28);
    beyond, both round to v itself)."""
    L = ref.LEVELS
    out = []
    for k in range(15):
        lo, hi = _ordinal(L[k]), _ordinal(L[k + 1])  # the test is false at lo, true at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            v = _from_ordinal(mid)
            if np.abs(v - L[k + 1]) < np.abs(v - L[k]):
                hi = mid
            else:
                lo = mid
        out.append(_from_ordinal(hi))
    return np.array(out, np.float32)


_THRESHOLDS = [float(t) for t in _thresholds()]
_TIE_ABOVE = 16777220.0  # 2^24 + 4: from here on the top two distances round equal


def _nearest(v: mx.array, bits: mx.array) -> mx.array:
    code = (v >= _THRESHOLDS[0]).astype(mx.uint8)
    for t in _THRESHOLDS[1:]:
        code = code + (v >= t).astype(mx.uint8)
    code = code - (v >= _TIE_ABOVE).astype(mx.uint8)
    finite = (bits & 0x7FFFFFFF) < 0x7F800000  # bit test on v's pattern: safe under fast math
    return mx.where(finite, code, mx.array(0, mx.uint8))


# compares and integer adds only (no float arithmetic to contract or relax): safe to fuse;
# fused on the GPU only, as fp8.enc (a CPU-backend fusion costs a C++ compile)
_nearest_fused = mx.compile(_nearest, shapeless=True)


def nearest_level(v: mx.array) -> mx.array:
    """Index of the nearest level per float32 value; ties keep the lower index. A non-finite
    v (butterfly overflow near 3.4e38) has no strictly smaller distance: index 0."""
    v = v.astype(mx.float32)
    fn = _nearest_fused if mx.default_device() == mx.gpu else _nearest
    return fn(v, v.view(mx.uint32))


def encode(x: mx.array) -> tuple[mx.array, mx.array]:
    """x[R, n] float32 -> (codes[R, n/2] uint8, radius[R] float32)."""
    x = x.astype(mx.float32)
    rows, n = x.shape
    if not rotatable(n):  # widths the rotation rejects are inert
        return mx.zeros((rows, n // 2), mx.uint8), mx.zeros((rows,), mx.float32)
    norm = row_norms(x)
    live = (norm > ref._TINY.item()) & ~(norm > ref._HUGE.item())
    safe = mx.where(live, norm, mx.array(1.0, mx.float32), stream=mx.cpu)
    invstd = mx.divide(mx.array(np.sqrt(np.float32(n))), safe, stream=mx.cpu)
    code = nearest_level(rotate(x) * invstd[:, None])
    packed = code[:, 0::2] | (code[:, 1::2] << mx.array(4, mx.uint8))
    codes = mx.where(live[:, None], packed, mx.array(0, mx.uint8))
    return codes, mx.where(live, norm, mx.array(0.0, mx.float32))


def step(radius: mx.array, n: int) -> mx.array:
    """Per-row level multiplier radius / sqrtf(n) (CPU stream: exact IEEE division);
    0 where radius <= 0 or non-finite."""
    radius = radius.astype(mx.float32)
    ok = (radius > 0) & ~mx.isinf(radius) & ~mx.isnan(radius)
    q = mx.divide(radius, mx.array(np.sqrt(np.float32(n))), stream=mx.cpu)
    return mx.where(ok, q, mx.array(0.0, mx.float32))


def unpack_levels(codes: mx.array) -> mx.array:
    """[..., n/2] bytes -> [..., n] float32 levels (unscaled, rotated domain)."""
    return _PAIR_LEVELS[codes].reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def decode_rotated(codes: mx.array, radius: mx.array, n: int) -> mx.array:
    """Scaled levels in the rotated domain, [..., n] float32 (decode without the unrotate)."""
    return unpack_levels(codes) * step(radius, n)[..., None]


def decode(codes: mx.array, radius: mx.array, n: int) -> mx.array:
    """codes[R, n/2], radius[R] -> x[R, n] float32. Widths the rotation rejects decode to 0."""
    if not rotatable(n):
        return mx.zeros((*codes.shape[:-1], n), mx.float32)
    # radii >= 2^64 decode at radius * 2^-64 and are scaled back (exact powers of two): the
    # numpy reference's guard against the butterfly overflowing near float32 max (ref.narrowed)
    radius = radius.astype(mx.float32)
    wide = radius >= mx.array(ref._WIDE)
    radius = mx.where(wide, radius * mx.array(ref._NARROW), radius)
    x = unrotate(decode_rotated(codes, radius, n))
    return x * mx.where(wide, mx.array(ref._WIDE), mx.array(np.float32(1.0)))[..., None]
