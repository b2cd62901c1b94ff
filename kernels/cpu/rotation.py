"""The random rotation shared by tq4 and polar (DESIGN.md "KV tiers").

    y = H(D x),  x = D H(y)

D is a diagonal of signs: D_i = -1 when bit 0 of splitmix32(0x9E3779B9 ^ i) is 1, else +1.
H is the in-place radix-2 Walsh-Hadamard butterfly (stages len = 1, 2, ..., n/2; the pair
a[j], a[j+len] becomes a[j]+a[j+len], a[j]-a[j+len]) followed by one multiply of every
element by float32(1)/sqrtf(n). All arithmetic is float32 in exactly that order, so the
result equals a C float implementation bit for bit. Widths must be powers of two in
2..2048 (`rotatable(n)`); the codecs treat any other width as inert.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

MAX_WIDTH = 2048
_GOLDEN = np.uint32(0x9E3779B9)


def rotatable(n: int) -> bool:
    """True for the widths the rotation (and so tq4/polar) accepts: 2, 4, ..., 2048."""
    return 2 <= n <= MAX_WIDTH and n & (n - 1) == 0


def splitmix32(x: np.ndarray) -> np.ndarray:
    """The splitmix32 finalizer on uint32 values (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint32) + _GOLDEN
    x = (x ^ (x >> np.uint32(16))) * np.uint32(0x85EBCA6B)
    x = (x ^ (x >> np.uint32(13))) * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


@lru_cache(maxsize=None)
def signs(n: int) -> np.ndarray:
    """D as float32 +-1 of length n (read-only; cached per width)."""
    h = splitmix32(_GOLDEN ^ np.arange(n, dtype=np.uint32))
    d = np.where(h & np.uint32(1), np.float32(-1.0), np.float32(1.0)).astype(np.float32)
    d.setflags(write=False)
    return d


def _check(n: int) -> None:
    if not rotatable(n):
        raise ValueError(f"rotation width {n=} must be a power of two in 2..{MAX_WIDTH}")


_BLOCK_VALUES = 1 << 17  # rows are transformed in blocks of about this many values (L2-sized)


def hadamard(a: np.ndarray) -> np.ndarray:
    """H on the last axis: the butterfly stages then the 1/sqrt(n) multiply. Returns a new array.

    Each block of rows is transposed to [n, rows] so that every stage is two contiguous
    vector ops (a row-major stage with len = 1 would stride by 2 elements). The arithmetic
    per element is the same as the scalar loop's, so the layout does not change any bit.
    """
    n = a.shape[-1]
    _check(n)
    flat = np.asarray(a, dtype=np.float32).reshape(-1, n)
    out = np.empty(flat.shape, dtype=np.float32)
    step = max(1, _BLOCK_VALUES // n)
    for i in range(0, flat.shape[0], step):  # a loop over cache-sized blocks, not rows
        out[i:i + step] = _hadamard_columns(flat[i:i + step].T.copy()).T  # a copy: never the input
    return out.reshape(a.shape)


def _hadamard_columns(at: np.ndarray) -> np.ndarray:
    """In place on at[n, rows] (one row per column); returns at."""
    n, rows = at.shape
    h = 1
    # float32 as the contract has it: rows near the float32 limit overflow to Inf (and
    # Inf - Inf to NaN) just as in the C engine; the codecs' rules handle such rows.
    with np.errstate(over="ignore", invalid="ignore"):
        while h < n:  # log2(n) stages; each is one float32 add and one subtract
            v = at.reshape(n // (2 * h), 2, h * rows)
            lo, hi = v[:, 0, :], v[:, 1, :]
            s = lo + hi
            np.subtract(lo, hi, out=hi)
            lo[...] = s
            h *= 2
        at *= np.float32(1.0) / np.sqrt(np.float32(n))
    return at


def rotate_columns(xt: np.ndarray) -> np.ndarray:
    """In place on a contiguous float32 xt[n, rows] holding one row per column: H(D x)."""
    _check(xt.shape[0])
    xt *= signs(xt.shape[0])[:, None]
    return _hadamard_columns(xt)


def unrotate_columns(yt: np.ndarray) -> np.ndarray:
    """In place on a contiguous float32 yt[n, rows] holding one row per column: D H(y)."""
    _check(yt.shape[0])
    _hadamard_columns(yt)
    yt *= signs(yt.shape[0])[:, None]
    return yt


def rotate(x: np.ndarray) -> np.ndarray:
    """y = H(D x) on the last axis (float32)."""
    x = np.asarray(x, dtype=np.float32)
    _check(x.shape[-1])
    return hadamard(x * signs(x.shape[-1]))


def unrotate(y: np.ndarray) -> np.ndarray:
    """x = D H(y) on the last axis (float32); the inverse of rotate."""
    y = np.asarray(y, dtype=np.float32)
    out = hadamard(y)
    out *= signs(y.shape[-1])
    return out
