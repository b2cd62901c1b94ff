"""Native CPU consumers of a coded KV row plane: scores and contexts straight from the codes.

Both functions take an optional batch of independent rows (leading axis B): every slot of
a ragged decode step is one b, with its own keys.

    scores(tier, q[B, M, n], codes[B, T, w], scales[B, T])     -> [B, M, T]   q . row_t
    context(tier, p[B, M, T], codes[B, T, w], scales[B, T], n) -> [B, M, n]   sum_t p_t row_t

`row_t` is what `kernels.cpu.codecs.decode_rows` would return for (codes[b, t], scales[b, t]);
the consumers must equal decode-then-multiply within float32 rounding but never build the
decoded f32 rows of the cache (the per-tier tricks are documented beside each function).
Callers pass codes that are safe to read: positions that are masked out carry code 0 and
scale 0, never garbage.
"""
from __future__ import annotations

import threading

import numpy as np

from kernels.cpu import fp8, polar, tq4
from kernels.cpu.rotation import rotatable, rotate, unrotate
from kernels.tiers import Tier, TierError, get_tier


def _f32_scores(q: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return np.matmul(q, codes.swapaxes(-1, -2))


def _f32_context(p: np.ndarray, codes: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    return np.matmul(p, codes)


# kind (or tier name, where the kind alone is not enough: polar2..6) -> (scores, context);
# the quantized kinds register theirs below.
_CONSUMERS = {"f32": (_f32_scores, _f32_context)}


def _pick(tier: Tier):
    tier = get_tier(tier)
    found = _CONSUMERS.get(tier.name) or _CONSUMERS.get(tier.kind)
    if found is None:
        raise TierError(f"{tier.name}: no numpy consumer for kind {tier.kind!r}")
    return found


def scores(tier: Tier, q: np.ndarray, codes: np.ndarray, scales: np.ndarray,
           counter: "WorkCounter | None" = None) -> np.ndarray:
    """q[..., M, n] against the coded rows [..., T, w] -> [..., M, T] float32. Polar tiers
    rebuild rows and add them to `counter` (required for them)."""
    tier = get_tier(tier)
    _check_codes(tier, codes, scales, q.shape[-1], "q.shape[-1]")
    return _pick(tier)[0](q, codes, scales, *_counter_for(tier, counter))


def context(tier: Tier, p: np.ndarray, codes: np.ndarray, scales: np.ndarray, n: int,
            counter: "WorkCounter | None" = None) -> np.ndarray:
    """Weights p[..., M, T] times the coded rows [..., T, w] -> [..., M, n] float32."""
    tier = get_tier(tier)
    _check_codes(tier, codes, scales, n, "n")
    return _pick(tier)[1](p, codes, scales, n, *_counter_for(tier, counter))


def _check_codes(tier: Tier, codes: np.ndarray, scales: np.ndarray, n: int, what: str) -> None:
    """codes' last axis must be the tier's code width for rows of width n (a polar stream is
    otherwise read at the wrong width, garbage, and tq4 unrotates at the codes' width), and
    there is one scale per row (a shorter scales array would broadcast one row's scale
    over all of them)."""
    width = tier.code_width(n)  # TierError for widths the tier cannot hold (e.g. odd for tq4)
    if codes.ndim < 2 or codes.shape[-1] != width:
        raise TierError(f"{tier.name}: codes shape {codes.shape} must end in [T, {width}] "
                        f"for rows of width {what}={n}")
    if np.shape(scales) != codes.shape[:-1]:
        raise TierError(f"{tier.name}: scales shape {np.shape(scales)} must equal codes' "
                        f"leading shape {codes.shape[:-1]}")


def _counter_for(tier: Tier, counter) -> tuple:
    if tier.kind != "polar":
        return ()
    if counter is None:
        raise ValueError(f"{tier.name}: the polar consumers rebuild rows to float32; pass "
                         f"counter=WorkCounter() (e.g. the pool's `rebuilds`) so the work is counted")
    return (counter,)


# ---- quantized kinds (kv8, tq4, polar) ------------------------------------------------------
# Scales broadcast as [..., 1, T] (per token, after the dot) or are folded into the weights p.

def _per_token(scales: np.ndarray) -> np.ndarray:
    return np.asarray(scales, dtype=np.float32)[..., None, :]


def _fp8_levels(codes: np.ndarray) -> np.ndarray:
    """Unscaled table values [..., T, n]; the per-row scale is applied after the dot."""
    return fp8.table_values(codes)


def _fp8_scores(q: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    s = np.matmul(q, _fp8_levels(codes).swapaxes(-1, -2))
    s *= _per_token(scales)
    return s


def _fp8_context(p: np.ndarray, codes: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    return np.matmul(p * _per_token(scales), _fp8_levels(codes))


# tq4: x_t = D H(c_t * step_t) with c_t the codebook levels and H = H^T, so
#   q . x_t = (H D q) . c_t * step_t = rotate(q) . c_t * step_t
#   sum_t p_t x_t = D H(sum_t p_t step_t c_t) = unrotate(sum_t p_t step_t c_t)
# One rotation per query row, one unrotate per context row, none per cached token.

def _tq_levels(codes: np.ndarray) -> np.ndarray:
    """Codebook levels [..., T, n], unscaled (one 8-byte table word gathered per code byte)."""
    return tq4.unpack_levels(codes)


def _tq_scores(q: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n = q.shape[-1]
    if not rotatable(n):  # inert width: every row decodes to zeros
        return np.zeros((*np.broadcast_shapes(q.shape[:-2], codes.shape[:-2]),
                         q.shape[-2], codes.shape[-2]), dtype=np.float32)
    s = np.matmul(rotate(q), _tq_levels(codes).swapaxes(-1, -2))
    s *= _per_token(tq4.step(scales, n))
    return s


def _tq_context(p: np.ndarray, codes: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    if not rotatable(n):
        return np.zeros((*np.broadcast_shapes(p.shape[:-2], codes.shape[:-2]), p.shape[-2], n),
                        dtype=np.float32)
    acc = np.matmul(p * _per_token(tq4.step(scales, n)), _tq_levels(codes))
    return unrotate(acc)


# polar: the angle tree has no per-coordinate codebook to dot through, so the rows are rebuilt
# in the rotated domain (the unrotate is still saved: q is rotated once, the context
# unrotated once). Every rebuilt row is added to the caller's WorkCounter (a pool owns one,
# so each worker counts its own work, also when several share a process).

class WorkCounter:
    """A thread-safe running count of work units (here: polar rows rebuilt to float32)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, k: int) -> None:
        with self._lock:
            self._value += int(k)

    @property
    def value(self) -> int:
        return self._value


def _polar_rows_t(codes: np.ndarray, scales: np.ndarray, n: int, bits: int,
                  counter: WorkCounter) -> np.ndarray:
    """Rebuilt rows in the rotated domain, transposed: [..., n, T] (counted)."""
    lead, T = codes.shape[:-2], codes.shape[-2]
    flat = codes.reshape(-1, codes.shape[-1])
    counter.add(flat.shape[0])
    yt = polar.decode_rotated_columns(flat, np.asarray(scales, np.float32).reshape(-1), n, bits)
    return np.moveaxis(yt.reshape(n, *lead, T), 0, -2)


def _polar_consumers(bits: int):
    def _scores(q: np.ndarray, codes: np.ndarray, scales: np.ndarray,
                counter: WorkCounter) -> np.ndarray:
        n = q.shape[-1]
        if not rotatable(n):
            return _tq_scores(q, codes, scales)  # the zeros of an inert width
        return np.matmul(rotate(q), _polar_rows_t(codes, scales, n, bits, counter))

    def _context(p: np.ndarray, codes: np.ndarray, scales: np.ndarray, n: int,
                 counter: WorkCounter) -> np.ndarray:
        if not rotatable(n):
            return _tq_context(p, codes, scales, n)
        return unrotate(np.matmul(p, _polar_rows_t(codes, scales, n, bits, counter)
                                  .swapaxes(-1, -2)))

    return _scores, _context


_CONSUMERS["fp8"] = (_fp8_scores, _fp8_context)
_CONSUMERS["tq"] = (_tq_scores, _tq_context)
_CONSUMERS.update({f"polar{b}": _polar_consumers(b) for b in range(2, 7)})
