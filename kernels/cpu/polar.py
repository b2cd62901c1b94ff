"""polarB (PolarQuant, B = 2..6) rows, per DESIGN.md "KV tiers".

Per row of width n (power of two, 2..2048; other widths are inert), after the tq4 norm,
inert rule and rotation r = rotate(x):
  level l = 1 .. log2(n): angle_j = atan2(r[2j+1], r[2j]), r_j <- hypot(r[2j], r[2j+1])
  level 1:  B bits, q = floor((angle + pi) * (0.5/pi) * 2^B) clamped to [0, 2^B-1],
            centre = -pi + (q + 0.5) * 2pi / 2^B
  level>1:  b = max(1, B-1) bits on [pi/4 - w, pi/4 + w], w = min(1.5/sqrtf(2^(l-1)), pi/4):
            q = floor((angle - (pi/4 - w)) / (2w) * 2^b) clamped,
            centre = (pi/4 - w) + (q + 0.5) * 2w / 2^b
  bit stream: codes LSB first at a running bit cursor, level 1 first (index order within a
  level), bytes = Tier.row_bytes(n); the scale is the radius (the row norm).
Decode: r = [radius], then from the top level down r[2j] = r_j cos(c), r[2j+1] = r_j sin(c),
then unrotate. radius <= 0 or non-finite decodes to zeros.

All float32 (pi is float32(pi); 0.5/pi is float32 0.5f/pi_f, which equals float32(0.5/pi)).
numpy's float32 atan2/hypot/cos/sin may differ from another libm in the last bit, so codes
are exact up to boundary flips, as the contract allows.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from kernels.cpu.rotation import rotatable, rotate, unrotate
from kernels.cpu.tq4 import live_rows, row_norms

PI = np.float32(math.pi)
QUARTER_PI = PI / np.float32(4.0)
HALF_OVER_PI = np.float32(0.5) / PI
TWO_PI = np.float32(2.0) * PI


@lru_cache(maxsize=None)
def layout(n: int, bits: int) -> tuple[tuple[int, int, float, float], ...]:
    """Per level (count, bits, lo, width): level 1 has lo = -pi, width 2pi over B bits; deeper
    levels lo = pi/4 - w, width 2w. lo/width are float32 values (as Python floats)."""
    levels = []
    count, lvl = n // 2, 1
    while count >= 1:
        if lvl == 1:
            levels.append((count, bits, float(-PI), float(TWO_PI)))
        else:
            w = min(np.float32(1.5) / np.sqrt(np.float32(2.0 ** (lvl - 1))), QUARTER_PI)
            w = np.float32(w)
            levels.append((count, max(1, bits - 1), float(QUARTER_PI - w), float(np.float32(2) * w)))
        count //= 2
        lvl += 1
    return tuple(levels)


def stream_bits(n: int, bits: int) -> int:
    return sum(c * b for c, b, _, _ in layout(n, bits))


def _quantize(angle: np.ndarray, lvl: int, b: int, lo: np.float32, width: np.float32) -> np.ndarray:
    top = np.float32(2 ** b)
    if lvl == 1:
        t = (angle + PI) * HALF_OVER_PI * top
    else:
        t = (angle - lo) / width * top
    q = np.floor(t)
    q[np.isnan(q)] = 0  # only after a butterfly overflow (norms near 3.4e38); keep it defined
    np.clip(q, 0, 2 ** b - 1, out=q)
    return q.astype(np.int64)


def _centre(q: np.ndarray, b: int, lo: np.float32, width: np.float32) -> np.ndarray:
    return lo + (q.astype(np.float32) + np.float32(0.5)) * width / np.float32(2 ** b)


def _pack(fields: list[tuple[np.ndarray, int]], rows: int, total: int) -> np.ndarray:
    """LSB-first bit stream of (codes[R, c], bits) fields, in order -> [R, ceil(total/8)] bytes."""
    parts = [((q[:, :, None] >> np.arange(b)) & 1).astype(np.uint8).reshape(rows, -1)
             for q, b in fields]
    stream = np.concatenate(parts, axis=1)
    pad = (-total) % 8
    if pad:
        stream = np.concatenate([stream, np.zeros((rows, pad), np.uint8)], axis=1)
    return np.packbits(stream, axis=1, bitorder="little")


def encode(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """x[R, n] float32 -> (codes[R, row_bytes] uint8, radius[R] float32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    nbytes = math.ceil(((n // 2) * bits + (n // 2 - 1) * max(1, bits - 1)) / 8)
    codes = np.zeros((rows, nbytes), dtype=np.uint8)
    radius = np.zeros(rows, dtype=np.float32)
    norm = row_norms(x)
    live = live_rows(norm, n)
    if not live.any():
        return codes, radius
    r = rotate(x[live])
    fields = []
    for lvl, (count, b, lo, width) in enumerate(layout(n, bits), start=1):
        pairs = r.reshape(r.shape[0], count, 2)
        angle = np.arctan2(pairs[:, :, 1], pairs[:, :, 0])
        r = np.hypot(pairs[:, :, 0], pairs[:, :, 1])
        fields.append((_quantize(angle, lvl, b, np.float32(lo), np.float32(width)), b))
    codes[live] = _pack(fields, int(live.sum()), stream_bits(n, bits))
    radius[live] = norm[live]
    return codes, radius


def _unpack(codes: np.ndarray, n: int, bits: int) -> list[np.ndarray]:
    stream = np.unpackbits(codes, axis=1, bitorder="little")
    out, cur = [], 0
    for count, b, _, _ in layout(n, bits):
        f = stream[:, cur:cur + count * b].reshape(-1, count, b).astype(np.int64)
        out.append((f << np.arange(b)).sum(axis=-1))
        cur += count * b
    return out


def decode_rotated(codes: np.ndarray, radius: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Rows in the rotated domain [R, n] float32 (decode without the unrotate)."""
    radius = np.asarray(radius, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        ok = (radius > 0) & np.isfinite(radius)
    r = np.where(ok, radius, np.float32(0.0)).astype(np.float32)[:, None]
    fields = _unpack(codes, n, bits)
    for q, (count, b, lo, width) in zip(reversed(fields), reversed(layout(n, bits))):
        c = _centre(q, b, np.float32(lo), np.float32(width))
        r = np.stack([r * np.cos(c), r * np.sin(c)], axis=-1).reshape(r.shape[0], 2 * count)
    return r


def decode(codes: np.ndarray, radius: np.ndarray, n: int, bits: int) -> np.ndarray:
    """codes[R, row_bytes], radius[R] -> x[R, n] float32."""
    if not rotatable(n):
        return np.zeros((codes.shape[0], n), dtype=np.float32)
    return unrotate(decode_rotated(codes, radius, n, bits))
