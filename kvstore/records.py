"""KV records as plain numpy arrays, and the byte layout of one record on disk.

A record is one token's cache across all layers. `KVRecords` holds a range of them:

    tokens      [T] int32
    l_codes     [layers, T, wL]   tier code dtype (float32 for f32, uint8 otherwise)
    l_scale     [layers, T]       float32 (ones for f32)
    r_codes     [layers, T, wR]
    r_scale     [layers, T]
    index_rows  [n_indexer_layers, T, index_hd] float32, or None without DSA

with wL/wR = tier.code_width(kv_lora / rope). The pool adapter copies these to and from
its planes (KVPool.read_rows / write_coded).

One record on disk (both formats; little-endian, packed, no padding):

    int32 token
    for each layer:  L codes  (tier.row_bytes(kv_lora) bytes)
                     L scale  float32            -- kv8/tq/polar only (v2/v3)
                     R codes  (tier.row_bytes(rope) bytes)
                     R scale  float32            -- kv8/tq/polar only
    for each indexer layer: index_hd float32     -- DSA models only

This is exactly the C engine's `.coli_kv` record; the Arrow format stores the same bytes
minus the token (see kvstore/disk.py), so conversion between the two is a byte copy.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from kernels.tiers import Tier, TierError, get_tier
from kvstore.fingerprint import Fingerprint

F32_MAX = np.float32(3.4e38)


@dataclass
class KVRecords:
    tokens: np.ndarray
    l_codes: np.ndarray
    l_scale: np.ndarray
    r_codes: np.ndarray
    r_scale: np.ndarray
    index_rows: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def slice(self, start: int, stop: int) -> "KVRecords":
        idx = None if self.index_rows is None else self.index_rows[:, start:stop]
        return KVRecords(self.tokens[start:stop], self.l_codes[:, start:stop],
                         self.l_scale[:, start:stop], self.r_codes[:, start:stop],
                         self.r_scale[:, start:stop], idx)

    @staticmethod
    def concat(parts: list["KVRecords"]) -> "KVRecords":
        idx = (None if parts[0].index_rows is None
               else np.concatenate([p.index_rows for p in parts], axis=1))
        return KVRecords(np.concatenate([p.tokens for p in parts]),
                         np.concatenate([p.l_codes for p in parts], axis=1),
                         np.concatenate([p.l_scale for p in parts], axis=1),
                         np.concatenate([p.r_codes for p in parts], axis=1),
                         np.concatenate([p.r_scale for p in parts], axis=1), idx)


class RecordLayout:
    """The packed record of one (model fingerprint, tier); packs/unpacks KVRecords."""

    def __init__(self, fp: Fingerprint, tier: Tier | str):
        self.fp, self.tier = fp, get_tier(tier)
        self.wl, self.wr = self.tier.code_width(fp.kv_lora), self.tier.code_width(fp.rope)

    @property
    def record_bytes(self) -> int:
        """Bytes of one record, token included."""
        return (4 + self.fp.n_layers * self.tier.token_bytes(self.fp.kv_lora, self.fp.rope)
                + 4 * self.fp.n_indexer_layers * self.fp.index_hd)

    def empty(self) -> KVRecords:
        return self.allocate(0)

    def allocate(self, n: int) -> KVRecords:
        code = self.tier.code_dtype()
        nl = self.fp.n_layers
        idx = (np.zeros((self.fp.n_indexer_layers, n, self.fp.index_hd), np.float32)
               if self.fp.index_hd else None)
        return KVRecords(np.zeros(n, np.int32), np.zeros((nl, n, self.wl), code),
                         np.ones((nl, n), np.float32), np.zeros((nl, n, self.wr), code),
                         np.ones((nl, n), np.float32), idx)

    def check(self, recs: KVRecords) -> None:
        """Shapes and dtypes of `recs` against this layout; errors name the field."""
        t, nl, code = len(recs), self.fp.n_layers, np.dtype(self.tier.code_dtype())
        want = {"tokens": ((t,), np.int32), "l_codes": ((nl, t, self.wl), code),
                "l_scale": ((nl, t), np.float32), "r_codes": ((nl, t, self.wr), code),
                "r_scale": ((nl, t), np.float32)}
        if self.fp.index_hd:
            want["index_rows"] = ((self.fp.n_indexer_layers, t, self.fp.index_hd), np.float32)
        elif recs.index_rows is not None:
            raise ValueError(f"index_rows given but the model has no DSA indexer ({self.fp.describe()})")
        for name, (shape, dtype) in want.items():
            a = getattr(recs, name)
            if a is None or a.shape != shape or a.dtype != dtype:
                got = None if a is None else (a.shape, a.dtype)
                raise ValueError(f"KVRecords.{name}: got {got}, want {(shape, np.dtype(dtype))} "
                                 f"for tier {self.tier.name}")

    def views(self, buf: np.ndarray, tokens: np.ndarray | None = None) -> KVRecords:
        """KVRecords whose arrays are strided views into `buf` (no copy; writable if buf is).

        buf is uint8 holding T whole records back to back; with `tokens` given, the records
        are stored without their int32 token (the Arrow payload) and `tokens` is used."""
        buf = buf.reshape(-1)
        rb = self.record_bytes - (4 if tokens is not None else 0)
        if buf.size % rb:
            raise ValueError(f"{buf.size} bytes is not a whole number of {rb}-byte records")
        t = buf.size // rb
        if t == 0:
            return self.empty()
        t32 = self.tier.kind == "f32"
        code, cs = (np.dtype("<f4"), 4) if t32 else (np.dtype("u1"), 1)
        lb = self.tier.token_bytes(self.fp.kv_lora, self.fp.rope)  # one layer's bytes
        rl, rr, sc = self.tier.row_bytes(self.fp.kv_lora), self.tier.row_bytes(self.fp.rope), 0 if t32 else 4
        base = 0 if tokens is not None else 4
        nl = self.fp.n_layers

        def view(shape, dtype, off, strides):
            return np.ndarray(shape, dtype, buffer=buf, offset=off, strides=strides)

        ones = None if not t32 else np.ones((nl, t), np.float32)
        return KVRecords(
            view((t,), "<i4", 0, (rb,)) if tokens is None else tokens,
            view((nl, t, self.wl), code, base, (lb, rb, cs)),
            ones if t32 else view((nl, t), "<f4", base + rl, (lb, rb)),
            view((nl, t, self.wr), code, base + rl + sc, (lb, rb, cs)),
            ones.copy() if t32 else view((nl, t), "<f4", base + rl + sc + rr, (lb, rb)),
            view((self.fp.n_indexer_layers, t, self.fp.index_hd), "<f4", base + nl * lb,
                 (4 * self.fp.index_hd, rb, 4)) if self.fp.index_hd else None)

    def pack(self, recs: KVRecords, with_token: bool = True) -> np.ndarray:
        """KVRecords -> uint8 [T, record_bytes] (or [T, record_bytes - 4] without tokens)."""
        self.check(recs)
        t = len(recs)
        out = np.empty((t, self.record_bytes - (0 if with_token else 4)), np.uint8)
        if t == 0:
            return out
        v = self.views(out, tokens=None if with_token else recs.tokens)
        if with_token:
            v.tokens[:] = recs.tokens
        v.l_codes[:] = recs.l_codes  # one strided copy per plane, not per row
        v.r_codes[:] = recs.r_codes
        if self.tier.quantized:
            v.l_scale[:] = recs.l_scale
            v.r_scale[:] = recs.r_scale
        if self.fp.index_hd:
            v.index_rows[:] = recs.index_rows
        return out


def sanitize(tier: Tier | str, recs: KVRecords) -> int:
    """Repair rows a loader must not trust, in place; returns how many rows were touched.

    kv8: a scale outside (0, 3.4e38) (NaN too) -> row codes 0, scale 1; codes 0x7F/0xFF
    (the e4m3fn NaNs) -> 0. tq/polar: a radius outside [0, 3.4e38] -> 0 (3.4e38 itself is
    the radius of a live row: the encoders make rows inert only above it). f32: untouched.
    """
    tier = get_tier(tier)
    touched = 0
    if tier.kind == "fp8":
        for codes, scale in ((recs.l_codes, recs.l_scale), (recs.r_codes, recs.r_scale)):
            bad = ~((scale > 0) & (scale < F32_MAX))
            if bad.any():
                codes[bad] = 0
                scale[bad] = 1.0
            # Rows holding a NaN code are rare: find them in one pass, fix only those rows
            # (a masked store over the whole strided plane is ~10x slower).
            hit = np.nonzero(_has_nan_code(codes))
            if hit[0].size:
                rows = codes[hit]
                rows[(rows & 0x7F) == 0x7F] = 0
                codes[hit] = rows
            touched += int(bad.sum()) + int(hit[0].size)
    elif tier.kind in ("tq", "polar"):
        for scale in (recs.l_scale, recs.r_scale):
            bad = ~((scale >= 0) & (scale <= F32_MAX))
            scale[bad] = 0.0
            touched += int(bad.sum())
    return touched


def _has_nan_code(codes: np.ndarray) -> np.ndarray:
    """[..., w] uint8 -> [...] bool: the row holds an e4m3fn NaN code (0x7F or 0xFF)."""
    if codes.shape[-1] % 4 or codes.strides[-1] != 1 or codes.size == 0:
        return np.equal(np.bitwise_and(codes, 0x7F), 0x7F).any(axis=-1)
    # SWAR over 4 bytes at a time (records keep 4-byte alignment; 8 would not be aligned):
    # x = b & 0x7F is <= 0x7F, so x + 1 sets bit 7 of its own byte, never carrying into the
    # next, exactly when x == 0x7F.
    x = np.bitwise_and(codes.view("<u4"), np.uint32(0x7F7F7F7F))
    x += np.uint32(0x01010101)
    x &= np.uint32(0x80808080)
    return x.any(axis=-1)


def requantize(recs: KVRecords, src: Tier | str, dst: Tier | str, fp: Fingerprint) -> KVRecords:
    """Recode records from tier `src` to `dst` (decode to f32, then encode_rows).

    f32 -> quantized is the v1 upgrade; quantized -> other tiers is lossy (used by convert).
    """
    src, dst = get_tier(src), get_tier(dst)
    if src == dst:
        return recs
    from kernels.cpu.codecs import decode_rows, encode_rows  # written by the codecs helper
    from kernels.cpu.rotation import rotatable
    if dst.kind in ("tq", "polar") and not (rotatable(fp.kv_lora) and rotatable(fp.rope)):
        # (the codecs store such rows as inert zeros: every record would be thrown away)
        raise TierError(f"tier {dst.name} rotates rows, which needs power-of-two widths "
                        f"2..2048; these records have kv_lora={fp.kv_lora} and rope={fp.rope}: "
                        f"use f32 or kv8")

    def f32(codes, scale, n):
        return codes if src.kind == "f32" else decode_rows(src, codes, scale, n)

    def enc(x):
        if dst.kind == "f32":
            return np.ascontiguousarray(x, np.float32), np.ones(x.shape[:-1], np.float32)
        codes, scale = encode_rows(dst, np.ascontiguousarray(x, np.float32))
        return codes.astype(np.uint8, copy=False), scale.astype(np.float32, copy=False)

    lc, ls = enc(f32(recs.l_codes, recs.l_scale, fp.kv_lora))
    rc, rs = enc(f32(recs.r_codes, recs.r_scale, fp.rope))
    return KVRecords(recs.tokens.copy(), lc, ls, rc, rs,
                     None if recs.index_rows is None else recs.index_rows.copy())
