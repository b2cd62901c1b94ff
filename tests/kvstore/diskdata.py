"""Shared test data for the on-disk KV cache tests: small fingerprints, hostile records."""
from __future__ import annotations

import numpy as np

from kernels.tiers import get_tier
from kvstore.fingerprint import Fingerprint
from kvstore.records import KVRecords, RecordLayout

FP = Fingerprint(3, 512, 64, 0, 0, 1000)  # the tiny model's shape class, no DSA
FP_DSA = Fingerprint(3, 512, 64, 16, 3, 1000)
SMALL = Fingerprint(2, 32, 8, 0, 0, 50)  # for byte-by-byte sweeps


def hostile_rows(rng: np.random.Generator, shape) -> np.ndarray:
    """Gaussian rows salted with NaN, +-Inf, huge, subnormal values and all-zero rows."""
    x = rng.standard_normal(shape).astype(np.float32) * rng.choice([0.01, 1, 300], shape[:-1])[..., None]
    flat = x.reshape(-1)
    k = max(1, flat.size // 200)
    for v in (np.nan, np.inf, -np.inf, 3.3e38, -1e30, 1e-40, -1e-42):
        flat[rng.integers(0, flat.size, k)] = v
    rows = x.reshape(-1, shape[-1])
    rows[rng.integers(0, rows.shape[0], max(1, rows.shape[0] // 50))] = 0.0
    return x


def records(fp: Fingerprint, tier, n: int, seed: int = 0, start: int = 0) -> KVRecords:
    """n records of `tier`: hostile f32 rows, or valid random codes with positive scales."""
    tier = get_tier(tier)
    rng = np.random.default_rng(seed)
    lay = RecordLayout(fp, tier)
    r = lay.allocate(n)
    r.tokens[:] = (np.arange(start, start + n) * 7919 + seed) % fp.vocab
    if tier.kind == "f32":
        r.l_codes[:] = hostile_rows(rng, r.l_codes.shape)
        r.r_codes[:] = hostile_rows(rng, r.r_codes.shape)
    else:
        for a in (r.l_codes, r.r_codes):
            a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)
            if tier.kind == "fp8":
                a[(a & 0x7F) == 0x7F] ^= 0x01  # valid e4m3fn codes only
        for s in (r.l_scale, r.r_scale):
            s[:] = rng.uniform(1e-3, 10, s.shape).astype(np.float32)
    if fp.index_hd:
        r.index_rows[:] = hostile_rows(rng, r.index_rows.shape)
    return r


def encoded(fp: Fingerprint, tier, n: int, seed: int = 0) -> tuple[KVRecords, KVRecords]:
    """(f32 hostile records, the same rows through encode_rows of `tier`)."""
    from kernels.cpu.codecs import encode_rows
    src = records(fp, "f32", n, seed)
    lc, ls = encode_rows(tier, src.l_codes)
    rc, rs = encode_rows(tier, src.r_codes)
    return src, KVRecords(src.tokens.copy(), lc, ls, rc, rs, src.index_rows)


def same(a: KVRecords, b: KVRecords) -> bool:
    """Byte equality of every array (NaN-safe)."""
    if len(a) != len(b):
        return False
    for name in ("tokens", "l_codes", "l_scale", "r_codes", "r_scale", "index_rows"):
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return False
        if x is not None and (x.shape != y.shape or x.dtype != y.dtype
                              or np.ascontiguousarray(x).tobytes() != np.ascontiguousarray(y).tobytes()):
            return False
    return True


def overwrite(path, data: bytes) -> None:
    """Make `path` hold exactly `data` (pwrite + ftruncate: much cheaper than O_TRUNC when a
    sweep rewrites the same file thousands of times)."""
    import os
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
