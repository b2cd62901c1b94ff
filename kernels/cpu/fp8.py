"""fp8 (OCP e4m3fn) row codec: the `kv8` tier, per DESIGN.md "KV tiers".

Per row: amax = max |x| ignoring NaN (an Inf counts). If not (amax > 1e-35) or
amax > 3.4e38 the row is inert (all bytes 0, scale 1). Else inv = 448/amax,
byte_i = enc(x_i * inv), scale = amax/448, all in float32.

enc(f) is computed on the float32 bit pattern (vectorized, no frexp): the RNE rounding of a
normal value to 3 mantissa bits is `(m + 0x7FFFF + lsb) >> 20` on the magnitude bits m, and
the float32 -> e4m3 exponent rebias is a subtraction of 120 << 3 from the combined
exponent|mantissa field, so a mantissa carry moves into the exponent exactly as the
contract's "k = 16 -> k = 8 and E+1" says. The thresholds are float32 constants (1e-35f,
3.4e38f, per "all arithmetic is float32"): a row whose amax is exactly 1e-35f is inert (a
double comparison would keep it; no other float32 value is read differently). `enc_reference` is the contract written out
literally (frexp / rint); the tests hold the two equal.
"""
from __future__ import annotations

import numpy as np

FP8_MAX = np.float32(448.0)
_TINY = np.float32(1e-35)
_HUGE = np.float32(3.4e38)

_ABS_MASK = np.uint32(0x7FFFFFFF)
_F32_INF = np.uint32(0x7F800000)
_F32_448 = np.uint32(0x43E00000)     # 448.0f: above this (or Inf) saturates to 0x7E
_F32_MIN_NORMAL8 = np.uint32(0x3C800000)  # 2^-6: below this the e4m3 code is subnormal
_REBIAS = np.uint32(120 << 3)        # (127 - 7) << 3


def _decode_table() -> np.ndarray:
    """float32 value of every byte; 0x7F and 0xFF (the e4m3fn NaNs) decode to 0."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, k = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, k * 2.0 ** -9, (8 + k) * 2.0 ** (e - 10))
    table = (sign * mag).astype(np.float32)
    table[[0x7F, 0xFF]] = 0.0
    table.setflags(write=False)
    return table


DECODE_TABLE = _decode_table()


def _pair_words() -> np.ndarray:
    """[65536] uint64: entry k holds the float32 values of the two bytes that the uint16 k
    has in memory, so a gather through codes.view(uint16) decodes two bytes at once (about
    twice as fast in numpy as DECODE_TABLE[codes]); built from the memory order, so it is
    endian-independent."""
    two = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(65536, 2)
    words = DECODE_TABLE[two].copy().view(np.uint64).reshape(65536)
    words.setflags(write=False)
    return words


_PAIR_WORDS = _pair_words()


def table_values(codes: np.ndarray) -> np.ndarray:
    """DECODE_TABLE[codes] for codes[..., n] uint8 (unscaled float32 [..., n])."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2 or codes.ndim == 0:
        return DECODE_TABLE[codes]
    return _PAIR_WORDS[codes.view(np.uint16)].view(np.float32)


def enc(f: np.ndarray) -> np.ndarray:
    """The contract's enc() of float32 values (already multiplied by inv) -> uint8 codes."""
    f = np.ascontiguousarray(f, dtype=np.float32)
    u = f.view(np.uint32)
    m = u & _ABS_MASK
    sign = (u >> np.uint32(24)) & np.uint32(0x80)
    # normal range: round-half-even to 3 mantissa bits, then rebias the exponent
    code = (m >> np.uint32(20)) & np.uint32(1)
    code += m
    code += np.uint32(0x7FFFF)
    code >>= np.uint32(20)
    code -= _REBIAS  # wraps for subnormal inputs; those lanes are replaced below
    small = m < _F32_MIN_NORMAL8
    if small.any():
        tiny = np.fmin(m.view(np.float32), np.float32(2.0 ** -6))  # keeps the cast defined
        sub = np.rint(tiny * np.float32(512.0)).astype(np.uint32)
        np.copyto(code, sub, where=small)
    np.copyto(code, np.uint32(0x7E), where=m > _F32_448)  # > 448, Inf and NaN (NaN fixed below)
    code |= sign
    np.copyto(code, np.uint32(0), where=m > _F32_INF)  # NaN -> 0x00
    return code.astype(np.uint8)


def enc_reference(f: np.ndarray) -> np.ndarray:
    """enc() transcribed from DESIGN.md step by step (frexp, rint); slow, for tests."""
    f = np.asarray(f, dtype=np.float32)
    sign = np.where(np.signbit(f), 0x80, 0).astype(np.int64)
    a = np.abs(f)
    with np.errstate(invalid="ignore", over="ignore"):
        mant, e = np.frexp(a)
        big_e = e.astype(np.int64) + 6
        k = np.rint(np.ldexp(a, (4 - e).astype(np.int32))).astype(np.float64)
        k = np.nan_to_num(k, nan=0.0, posinf=0.0).astype(np.int64)
        carry = k == 16
        k = np.where(carry, 8, k)
        big_e = np.where(carry, big_e + 1, big_e)
        normal = sign | (big_e << 3) | (k - 8)
        sat_norm = (big_e > 15) | ((big_e == 15) & (k > 14))
        normal = np.where(sat_norm, sign | 0x7E, normal)
        sub = sign | np.rint(a * np.float32(512.0)).astype(np.float64).clip(0, 8).astype(np.int64)
        out = np.where(a < np.float32(2.0 ** -6), sub, normal)
        out = np.where((a > FP8_MAX) | np.isinf(a), sign | 0x7E, out)
        out = np.where(np.isnan(f), 0, out)
    return out.astype(np.uint8)


_BLOCK_VALUES = 1 << 17  # encode in blocks of about this many values so temporaries stay in L2


def encode(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x[R, n] float32 -> (codes[R, n] uint8, scales[R] float32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = max(1, _BLOCK_VALUES // max(1, x.shape[-1]))
    if x.shape[0] <= rows:
        return _encode_block(x)
    codes = np.empty(x.shape, dtype=np.uint8)
    scales = np.empty(x.shape[0], dtype=np.float32)
    for i in range(0, x.shape[0], rows):  # a loop over cache-sized blocks, not rows
        codes[i:i + rows], scales[i:i + rows] = _encode_block(x[i:i + rows])
    return codes, scales


def _encode_block(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # a NaN does not raise amax: zeroed first, since fmax skips a quiet NaN but returns a
    # signalling one (0x7F800001...: x86's maxss), which made such a row inert
    a = np.abs(x)
    np.copyto(a, np.float32(0), where=np.isnan(a))
    amax = a.max(axis=-1, initial=np.float32(0))
    del a  # (a row-sized temporary: freed before the codes are made)
    with np.errstate(invalid="ignore"):
        live = (amax > _TINY) & ~(amax > _HUGE)
    safe = np.where(live, amax, FP8_MAX)
    inv = FP8_MAX / safe
    codes = enc(x * inv[:, None])
    codes[~live] = 0
    scales = np.where(live, safe / FP8_MAX, np.float32(1.0)).astype(np.float32)
    return codes, scales


def decode(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes[R, n] uint8, scales[R] -> float32 rows (table value times the row scale)."""
    out = table_values(codes)
    out *= np.asarray(scales, dtype=np.float32)[:, None]
    return out
