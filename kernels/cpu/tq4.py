"""tq4: rotated int4 rows (TurboQuant's MSE variant), per DESIGN.md "KV tiers".

Per row of width n (a power of two, 2..2048; any other width is inert):
    norm   = float32(sqrt(sum x_i^2)), the sum accumulated in float64 left to right
             (the C engine's loop order; numpy's pairwise sum could round differently)
    inert  when not (norm > 1e-35f) or norm > 3.4e38f (float32 constants, as for fp8): all
           codes 0, radius 0
    y      = rotate(x)
    invstd = float32(sqrtf(n) / norm)       -- our reading: sqrtf(n) in float32, then a
                                               float32 divide (one rounding each)
    code_i = index of the level nearest to v = y_i * invstd; distances |v - level_k|
             are float32 and a tie keeps the lower index
    byte i/2 = code i in the low nibble (i even) or high nibble (i odd); scale = radius = norm
Decode: level * float32(radius / sqrtf(n)), then unrotate; radius <= 0 or non-finite -> 0.
(Radii >= 2^64 go through an exact power-of-two rescale so that those near float32 max do
not overflow the butterfly; the bits are the contract's wherever its order stays finite.)

Nearest level without 16 distance passes: float32 subtraction is monotone, so the nearest
level is one of the two levels that bracket v; counting the levels <= v finds them and
the two float32 distances decide, with the lower index on a tie, exactly as the contract's scan.
(|v| <= sqrt(n) keeps non-adjacent levels from tying.) A non-finite v (only reachable when
the butterfly overflows for norms near 3.4e38) has no strictly smaller distance anywhere,
so the scan keeps index 0; we do the same.
"""
from __future__ import annotations

import numpy as np

from kernels.cpu.rotation import rotatable, rotate_columns, unrotate

LEVELS = np.array([-2.733, -2.069, -1.618, -1.256, -0.942, -0.657, -0.388, -0.128,
                   0.128, 0.388, 0.657, 0.942, 1.256, 1.618, 2.069, 2.733], dtype=np.float32)
LEVELS.setflags(write=False)
_TINY = np.float32(1e-35)
_HUGE = np.float32(3.4e38)


def _pair_table() -> np.ndarray:
    """[256, 2] float32: the two levels a packed byte holds (low nibble first)."""
    b = np.arange(256)
    t = np.stack([LEVELS[b & 0xF], LEVELS[b >> 4]], axis=-1).astype(np.float32)
    t.setflags(write=False)
    return t


PAIR_LEVELS = _pair_table()
# The same table with each pair viewed as one 8-byte word: a 1-D gather of uint64 is several
# times faster in numpy than gathering [256, 2] rows.
_PAIR_WORDS = PAIR_LEVELS.copy().view(np.uint64).reshape(256)


def column_norms(xt: np.ndarray) -> np.ndarray:
    """float32(sqrt(sum of squares)) of each column of xt[n, rows], accumulated in float64
    from index 0 upward (a reduction over the outer axis of a C-ordered array adds whole rows
    in order; a single column would be summed pairwise as a 1-D array, so it is doubled)."""
    with np.errstate(invalid="ignore"):  # (a signalling NaN quietly becomes a NaN row norm)
        sq = np.array(xt, dtype=np.float64, order="C")
    cols = sq.shape[1]
    if cols == 1:
        sq = np.repeat(sq, 2, axis=1)
    sq *= sq
    with np.errstate(over="ignore"):  # a norm past float32 becomes Inf: an inert row
        return np.sqrt(np.add.reduce(sq, axis=0)[:cols]).astype(np.float32)


def row_norms(x: np.ndarray) -> np.ndarray:
    """The contract's norm of each row of x[R, n]."""
    return column_norms(np.ascontiguousarray(np.asarray(x, dtype=np.float32).T))


def live_rows(norm: np.ndarray, n: int) -> np.ndarray:
    """Rows that are encoded: not (norm > 1e-35) or norm > 3.4e38 are inert, as are all rows
    of a width the rotation does not accept."""
    if not rotatable(n):
        return np.zeros(norm.shape, dtype=bool)
    with np.errstate(invalid="ignore"):
        return (norm > _TINY) & ~(norm > _HUGE)


def nearest_level(v: np.ndarray) -> np.ndarray:
    """Index of the nearest LEVELS entry per float32 value; ties keep the lower index."""
    lo = np.zeros(v.shape, dtype=np.uint8)
    for level in LEVELS[1:15]:  # lo = last level <= v, clamped to 0..14 (NaN -> 0)
        lo += v >= level
    d_lo = np.abs(v - LEVELS[lo])
    d_hi = np.abs(v - LEVELS[lo + np.uint8(1)])
    code = lo + (d_hi < d_lo)
    code[~np.isfinite(v)] = 0  # every distance is Inf/NaN: the scan keeps index 0
    return code


def unpack_levels(packed: np.ndarray) -> np.ndarray:
    """[..., n/2] bytes -> [..., n] float32 levels (unscaled, rotated domain)."""
    packed = np.asarray(packed, dtype=np.uint8)
    return _PAIR_WORDS[packed].view(np.float32)


_BLOCK_VALUES = 1 << 17  # rows are encoded in blocks of about this many values (L2-sized)


def encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x[R, n] float32 -> (codes[R, n/2] uint8, radius[R] float32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    codes = np.zeros((rows, n // 2), dtype=np.uint8)
    radius = np.zeros(rows, dtype=np.float32)
    if not rotatable(n):
        return codes, radius
    step_rows = max(1, _BLOCK_VALUES // n)
    for i in range(0, rows, step_rows):  # a loop over cache-sized blocks, not rows
        codes[i:i + step_rows], radius[i:i + step_rows] = _encode_block(x[i:i + step_rows])
    return codes, radius


def _encode_block(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One block, in the transposed layout xt[n, rows] (contiguous butterfly stages)."""
    n = x.shape[1]
    xt = x.T.copy()  # the butterfly works in place: never on the caller's rows
    norm = column_norms(xt)
    live = live_rows(norm, n)
    with np.errstate(invalid="ignore", over="ignore"):
        invstd = np.sqrt(np.float32(n)) / np.where(live, norm, np.float32(1.0))
        yt = rotate_columns(xt)  # inert rows may hold NaN/Inf; their codes are zeroed below
        yt *= invstd[None, :]
        ct = nearest_level(yt)
    packed = (ct[0::2] | (ct[1::2] << np.uint8(4))).T
    packed[~live] = 0
    return packed, np.where(live, norm, np.float32(0.0)).astype(np.float32)


def step(radius: np.ndarray, n: int) -> np.ndarray:
    """Per-row level multiplier radius / sqrtf(n); 0 where radius <= 0 or non-finite."""
    radius = np.asarray(radius, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        ok = (radius > 0) & np.isfinite(radius)
    return np.where(ok, radius / np.sqrt(np.float32(n)), np.float32(0.0)).astype(np.float32)


def decode_rotated(codes: np.ndarray, radius: np.ndarray, n: int) -> np.ndarray:
    """Scaled levels in the rotated domain, [R, n] float32 (decode without the unrotate)."""
    y = unpack_levels(codes)
    y *= step(radius, n)[:, None]
    return y


# Rows with radius >= 2^64 decode at radius * 2^-64 and are scaled back by 2^64 after the
# unrotate. The contract's order (level * step, butterfly, * 1/sqrtf(n), signs) has partial
# sums up to sqrt(n) times the row's largest value, which overflow for radii near float32
# max (Inf - Inf: NaN). A power-of-two scale commutes with every float32 add and multiply
# while nothing overflows or goes subnormal, and for these radii nothing does on either side
# of the scale (every rotated-domain value is at least 2^-27 of the radius: tq4 levels over
# sqrt(2048), the polar tree's cos/sin products), so a row whose contract-order decode is
# finite keeps exactly its bits; the rest get the rounded true values (+-Inf only where a
# value itself is past float32 max). Encode stores radii up to 3.4e38 (rows near 1e38
# already decoded to Inf/NaN); larger ones come from a hostile or corrupt file.
# polar.decode and the MLX decode share this.
_WIDE = np.float32(2.0 ** 64)
_NARROW = np.float32(2.0 ** -64)


def narrowed(radius: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the radius to decode with, the rows to multiply by 2^64 after the unrotate)."""
    radius = np.asarray(radius, dtype=np.float32)
    wide = radius >= _WIDE  # (NaN compares False; an Inf stays Inf and decodes to zeros)
    return np.where(wide, radius * _NARROW, radius).astype(np.float32), wide


def widen(x: np.ndarray, wide: np.ndarray) -> np.ndarray:
    """x[wide] *= 2^64 in place (a value past float32 max becomes +-Inf); returns x."""
    if wide.any():
        with np.errstate(over="ignore"):
            x[wide] *= _WIDE
    return x


def decode(codes: np.ndarray, radius: np.ndarray, n: int) -> np.ndarray:
    """codes[R, n/2], radius[R] -> x[R, n] float32. Widths the rotation rejects decode to 0."""
    if not rotatable(n):
        return np.zeros((codes.shape[0], n), dtype=np.float32)
    radius, wide = narrowed(radius)
    return widen(unrotate(decode_rotated(codes, radius, n)), wide)
