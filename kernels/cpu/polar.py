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
then unrotate. radius <= 0 or non-finite decodes to zeros. (Radii >= 2^64 are decoded
rescaled by an exact 2^-64 and scaled back, as in tq4.decode: no NaN at float32 max.)

All float32 (pi is float32(pi); 0.5/pi is float32 0.5f/pi_f, which equals float32(0.5/pi)).
numpy's float32 atan2/hypot/cos/sin may differ from another libm in the last bit, so codes
are exact up to boundary flips, as the contract allows. The encoder's atan2 is taken in
float64 and rounded to float32: numpy's own float32 atan2 depends on the CPU (its AVX-512
version differs from the correctly rounded value in ~38 % of inputs, its scalar path in
almost none), and the rounded float64 one agrees with libm's atan2f wherever that is
correctly rounded, on every machine.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from kernels.cpu.rotation import rotatable, rotate_columns, unrotate_columns
from kernels.cpu.tq4 import column_norms, live_rows, narrowed, widen

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


@lru_cache(maxsize=None)
def _stream_plan(n: int, bits: int) -> dict[str, np.ndarray]:
    """Where every code of a row sits in the LSB-first stream (all codes, level 1 first).

    A code of <= 6 bits at bit offset o lies in bytes o//8 and o//8 + 1, so decoding gathers
    those two bytes as a uint16 and shifts by o%8. Encoding works per byte: every byte is the
    OR of at most 8 code fragments (`contrib` lists them, padded with a dummy all-zero code;
    `part` 0 takes the low byte of code << o%8, 8 its high byte).
    """
    width = np.concatenate([np.full(c, b, np.int64) for c, b, _, _ in layout(n, bits)])
    offset = np.concatenate([[0], np.cumsum(width)[:-1]])
    ncodes, nbytes = len(width), -(-int(width.sum()) // 8)
    byte, shift = offset // 8, offset % 8
    spills = np.flatnonzero(shift + width > 8)
    key = np.concatenate([byte, byte[spills] + 1])
    code = np.concatenate([np.arange(ncodes), spills])
    part = np.concatenate([np.zeros(ncodes, np.int64), np.full(len(spills), 8)])
    order = np.argsort(key, kind="stable")
    key, code, part = key[order], code[order], part[order]
    rank = np.arange(len(key)) - np.searchsorted(key, key)  # position within its byte
    contrib = np.full((nbytes, int(rank.max()) + 1), ncodes, np.int64)
    parts = np.zeros(contrib.shape, np.uint16)
    contrib[key, rank], parts[key, rank] = code, part
    plan = {"byte": byte, "shift": shift.astype(np.uint16), "mask": ((1 << width) - 1).astype(np.uint16),
            "contrib": contrib, "part": parts}
    for v in plan.values():
        v.setflags(write=False)
    return plan


def _quantize(angle: np.ndarray, lvl: int, b: int, lo: np.float32, width: np.float32) -> np.ndarray:
    top = np.float32(2 ** b)
    if lvl == 1:
        t = (angle + PI) * HALF_OVER_PI * top
    else:
        t = (angle - lo) / width * top
    q = np.floor(t)
    q[np.isnan(q)] = 0  # only after a butterfly overflow (norms near 3.4e38); keep it defined
    np.clip(q, 0, 2 ** b - 1, out=q)
    return q.astype(np.uint16)


def _centre(q: np.ndarray, b: int, lo: np.float32, width: np.float32) -> np.ndarray:
    return lo + (q.astype(np.float32) + np.float32(0.5)) * width / np.float32(2 ** b)


@lru_cache(maxsize=None)
def _cos_sin(b: int, lo: float, width: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of all 2^b centres of a level (float32): a level has only 2^b distinct
    centres, so decoding gathers from these instead of evaluating cos/sin per code."""
    c = _centre(np.arange(2 ** b), b, np.float32(lo), np.float32(width))
    cs, sn = np.cos(c), np.sin(c)
    cs.setflags(write=False)
    sn.setflags(write=False)
    return cs, sn


# Rows are processed in blocks, transposed to [n, rows] (one row per column): each level's
# pairs r[2j], r[2j+1] are then whole contiguous rows, the bit plan gathers whole rows, and
# the butterfly runs in the same layout (rotation.rotate_columns / unrotate_columns).
_BLOCK_VALUES = 1 << 17


def _pack(q: np.ndarray, n: int, bits: int) -> np.ndarray:
    """All codes q[ncodes, rows] (level 1 first) -> the LSB-first stream [row_bytes, rows]."""
    plan = _stream_plan(n, bits)
    val = np.zeros((q.shape[0] + 1, q.shape[1]), np.uint16)  # last row: the dummy code
    np.left_shift(q, plan["shift"][:, None], out=val[:-1])
    out = np.zeros((plan["contrib"].shape[0], q.shape[1]), np.uint16)
    for p in range(plan["contrib"].shape[1]):  # <= 8 fragments per byte
        out |= val[plan["contrib"][:, p]] >> plan["part"][:, p, None]
    return (out & np.uint16(0xFF)).astype(np.uint8)


def _unpack(codes_t: np.ndarray, n: int, bits: int) -> list[np.ndarray]:
    """The stream [row_bytes, rows] -> per level codes [count, rows] uint16, level 1 first."""
    plan = _stream_plan(n, bits)
    padded = np.zeros((codes_t.shape[0] + 1, codes_t.shape[1]), np.uint16)
    padded[:-1] = codes_t
    word = padded[plan["byte"]]
    word |= padded[plan["byte"] + 1] << np.uint16(8)
    word >>= plan["shift"][:, None]
    word &= plan["mask"][:, None]
    cuts = np.cumsum([c for c, _, _, _ in layout(n, bits)])[:-1]
    return np.split(word, cuts, axis=0)


def encode(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """x[R, n] float32 -> (codes[R, row_bytes] uint8, radius[R] float32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    nbytes = math.ceil(((n // 2) * bits + (n // 2 - 1) * max(1, bits - 1)) / 8)
    codes = np.zeros((rows, nbytes), dtype=np.uint8)
    radius = np.zeros(rows, dtype=np.float32)
    if not rotatable(n):
        return codes, radius
    step = max(1, _BLOCK_VALUES // n)
    for i in range(0, rows, step):  # a loop over cache-sized blocks, not rows
        codes[i:i + step], radius[i:i + step] = _encode_block(x[i:i + step], bits)
    return codes, radius


def _encode_block(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[1]
    xt = x.T.copy()  # the butterfly works in place: never on the caller's rows
    norm = column_norms(xt)
    live = live_rows(norm, n)
    fields = []
    with np.errstate(invalid="ignore", over="ignore"):  # inert rows may be NaN/Inf: zeroed below
        r = rotate_columns(xt)
        for lvl, (count, b, lo, width) in enumerate(layout(n, bits), start=1):
            a, c = r[0::2], r[1::2]
            angle = np.arctan2(c.astype(np.float64), a.astype(np.float64)).astype(np.float32)
            fields.append(_quantize(angle, lvl, b, np.float32(lo), np.float32(width)))
            r = np.hypot(a, c)
    packed = _pack(np.concatenate(fields, axis=0), n, bits).T
    return (np.where(live[:, None], packed, np.uint8(0)),
            np.where(live, norm, np.float32(0.0)).astype(np.float32))


def decode_rotated_columns(codes: np.ndarray, radius: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Rows in the rotated domain, transposed: [n, R] float32 (decode without the unrotate)."""
    radius = np.asarray(radius, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        ok = (radius > 0) & np.isfinite(radius)
    r = np.where(ok, radius, np.float32(0.0)).astype(np.float32)[None, :]
    fields = _unpack(np.ascontiguousarray(np.asarray(codes, np.uint8).T), n, bits)
    for q, (count, b, lo, width) in zip(reversed(fields), reversed(layout(n, bits))):
        cs, sn = _cos_sin(b, lo, width)
        nxt = np.empty((count, 2, r.shape[1]), np.float32)
        np.multiply(r, cs[q], out=nxt[:, 0])
        np.multiply(r, sn[q], out=nxt[:, 1])
        r = nxt.reshape(2 * count, r.shape[1])
    return r


def decode_rotated(codes: np.ndarray, radius: np.ndarray, n: int, bits: int) -> np.ndarray:
    """Rows in the rotated domain [R, n] float32 (decode without the unrotate)."""
    return np.ascontiguousarray(decode_rotated_columns(codes, radius, n, bits).T)


def decode(codes: np.ndarray, radius: np.ndarray, n: int, bits: int) -> np.ndarray:
    """codes[R, row_bytes], radius[R] -> x[R, n] float32."""
    rows = codes.shape[0]
    out = np.zeros((rows, n), dtype=np.float32)
    if not rotatable(n):
        return out
    radius, wide = narrowed(radius)  # radii >= 2^64 decode rescaled: see tq4.narrowed
    step = max(1, _BLOCK_VALUES // n)
    for i in range(0, rows, step):  # a loop over cache-sized blocks, not rows
        yt = decode_rotated_columns(codes[i:i + step], radius[i:i + step], n, bits)
        out[i:i + step] = unrotate_columns(yt).T
    return widen(out, wide)
