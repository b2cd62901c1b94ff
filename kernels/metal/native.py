"""Hand-written Metal decode attention (mx.fast.metal_kernel) over the paged pool, for the
f32, kv8 and tq4 tiers: reads the codes in place through the block tables, no expansion.

UNVERIFIED: written on Linux, where MLX has no Metal; it has never been compiled or run.
It is therefore guarded: `usable(...)` runs it once per (tier, Dl, Dr, block size) on a
small hostile problem (NaN garbage, shuffled blocks, ragged rows, a prefill query beside a
padding one, a row whose every score lies below -1e30) against the MLX-op path
(kernels/metal/attention.py) and uses it only when they agree within 1e-5; a compile error
or a mismatch is logged once and the op path serves every call (counted as a fallback).

Launch: one threadgroup of 256 threads (8 simdgroups) per query row r = (b, q, h). Lane i
of a simdgroup holds dims i, i+32, ... of q and of its context (Dl/32 and Dr/32 floats, so
Dl and Dr must be multiples of 32). Simdgroup g walks keys t = g, g+8, ... up to q_pos with
its own online softmax; the 8 partial states are merged in threadgroup memory at the end.
Per key: score = (q_lat . V_L * w_L + q_rope . V_R * w_R) * scale with V the unscaled
values (f32 row; fp8: LUT[byte]; tq4: LUT[nibble], q pre-rotated) and w the row
multiplier (1; scale; radius/sqrt(n), 0 if radius <= 0 or not finite). For tq4 the output is
the rotated context; the wrapper unrotates it once.
"""
from __future__ import annotations

import logging
from functools import lru_cache

import mlx.core as mx
import numpy as np

from kernels.cpu import fp8 as cpu_fp8
from kernels.cpu import tq4 as cpu_tq4
from kernels.cpu.attention import LayerPlanes
from kernels.cpu.rotation import rotatable
from kernels.metal import rotation
from kernels.metal.backend import metal_available, metal_enabled
from kernels.tiers import Tier, get_tier

log = logging.getLogger(__name__)

_TIER_ID = {"f32": 0, "fp8": 1, "tq": 2}
_THREADS, _SIMDS = 256, 8

_SOURCE = """
    const uint r = threadgroup_position_in_grid.x;
    const uint tid = thread_position_in_threadgroup.x;
    const uint sg = simdgroup_index_in_threadgroup;
    const uint lane = thread_index_in_simdgroup;
    const uint QN = uint(dims[0]), HN = uint(dims[1]);
    const int NB = dims[2];
    const uint b = r / (QN * HN);
    const uint qi = (r / HN) % QN;
    const int pos = qpos[b * QN + qi];
    const float sm_scale = params[0];
    const float inv_sqrt_l = params[1];
    const float inv_sqrt_r = params[2];
    constexpr int EL = DL / 32;
    constexpr int ER = DR / 32;
    constexpr int WL = TIER == 0 ? DL : (TIER == 1 ? DL : DL / 2);
    constexpr int WR = TIER == 0 ? DR : (TIER == 1 ? DR : DR / 2);
    threadgroup float tg_acc[8 * DL];
    threadgroup float tg_m[8];
    threadgroup float tg_l[8];

    float qv[EL]; float rv[ER]; float acc[EL];
    for (int j = 0; j < EL; ++j) { qv[j] = ql[r * DL + lane + 32 * j]; acc[j] = 0.0f; }
    for (int j = 0; j < ER; ++j) { rv[j] = qr[r * DR + lane + 32 * j]; }
    // m counts only once the simdgroup has seen a key (l != 0; a NaN l counts, so a NaN
    // stays NaN): a fixed floor taken as the max put rows whose every score lies below it
    // to exp(s - floor) = 0, zeros where the op path and numpy give the argmax row
    float m = 0.0f, l = 0.0f;

    for (int t = int(sg); t <= pos; t += 8) {
        const int bi = t / BS;
        if (bi >= NB) break;
        const int blk = bt[b * NB + bi];
        if (blk < 0) continue;
        const long row = long(blk) * BS + (t % BS);
        float wl = ls[row], wr = rs[row];
        if (TIER == 0) { wl = 1.0f; wr = 1.0f; }
        if (TIER == 2) {
            wl = (wl > 0.0f && wl <= 3.4028235e38f) ? wl * inv_sqrt_l : 0.0f;
            wr = (wr > 0.0f && wr <= 3.4028235e38f) ? wr * inv_sqrt_r : 0.0f;
        }
        float vl[EL];
        float sl = 0.0f, sr = 0.0f;
        for (int j = 0; j < EL; ++j) {
            const int d = lane + 32 * j;
            float v;
            if (TIER == 0) { v = float(lc[row * WL + d]); }
            else if (TIER == 1) { v = lut[uint(lc[row * WL + d])]; }
            else { uint byte = uint(lc[row * WL + d / 2]); v = lut[(d & 1) ? (byte >> 4) : (byte & 15u)]; }
            vl[j] = v;
            sl += qv[j] * v;
        }
        for (int j = 0; j < ER; ++j) {
            const int d = lane + 32 * j;
            float v;
            if (TIER == 0) { v = float(rc[row * WR + d]); }
            else if (TIER == 1) { v = lut[uint(rc[row * WR + d])]; }
            else { uint byte = uint(rc[row * WR + d / 2]); v = lut[(d & 1) ? (byte >> 4) : (byte & 15u)]; }
            sr += rv[j] * v;
        }
        const float s = (metal::simd_sum(sl) * wl + metal::simd_sum(sr) * wr) * sm_scale;
        const bool seen = l != 0.0f;
        const float m_new = seen ? metal::max(m, s) : metal::max(s, -3.4028235e38f);  // -inf: p = 0
        const float alpha = seen ? metal::precise::exp(m - m_new) : 0.0f;  // acc, l are 0 then
        const float p = metal::precise::exp(s - m_new);
        l = l * alpha + p;
        const float pw = p * wl;
        for (int j = 0; j < EL; ++j) { acc[j] = acc[j] * alpha + pw * vl[j]; }
        m = m_new;
    }
    for (int j = 0; j < EL; ++j) { tg_acc[sg * DL + lane + 32 * j] = acc[j]; }
    if (lane == 0) { tg_m[sg] = m; tg_l[sg] = l; }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    float mm = -3.4028235e38f;  // the max over the simdgroups that saw a key
    for (int g = 0; g < 8; ++g) { if (tg_l[g] != 0.0f) mm = metal::max(mm, tg_m[g]); }
    float ll = 0.0f;
    float f[8];
    for (int g = 0; g < 8; ++g) {
        f[g] = tg_l[g] != 0.0f ? metal::precise::exp(tg_m[g] - mm) : 0.0f;
        ll += tg_l[g] * f[g];
    }
    for (int d = int(tid); d < DL; d += 256) {
        float o = 0.0f;
        for (int g = 0; g < 8; ++g) { o += tg_acc[g * DL + d] * f[g]; }
        out[r * DL + d] = ll != 0.0f ? o / ll : 0.0f;
    }
"""


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.metal_kernel(
        name="kvfleet_paged_mla_decode",
        input_names=["ql", "qr", "lc", "ls", "rc", "rs", "bt", "qpos", "lut", "params", "dims"],
        output_names=["out"], source=_SOURCE, compile_options={"math_mode": "safe"})


def _lut(tier: Tier) -> mx.array:
    if tier.kind == "fp8":
        return mx.array(cpu_fp8.DECODE_TABLE)
    table = np.zeros(256, np.float32)
    table[:16] = cpu_tq4.LEVELS
    return mx.array(table)


def supported(tier: Tier, Dl: int, Dr: int) -> bool:
    """Shapes the kernel handles: the three tiers, widths that are multiples of 32 up to 512."""
    if tier.kind == "tq" and not (rotatable(Dl) and rotatable(Dr)):
        return False
    # threadgroup memory holds 8 partial contexts: 8 * Dl floats must stay well under 32 KB
    return tier.kind in _TIER_ID and Dl % 32 == 0 and Dr % 32 == 0 and Dl <= 512 and Dr <= 512


def attend(tier: Tier, planes: LayerPlanes, block_tables: np.ndarray, q_lat: mx.array,
           q_rope: mx.array, q_pos: np.ndarray, scale: float) -> mx.array:
    """The kernel's launch; same contract as attention.paged_mla_attention (no checks)."""
    B, Q, H, Dl = q_lat.shape
    Dr = q_rope.shape[-1]
    ql = q_lat.astype(mx.float32).reshape(B * Q * H, Dl)
    qr = q_rope.astype(mx.float32).reshape(B * Q * H, Dr)
    if tier.kind == "tq":
        ql, qr = rotation.rotate_fast(ql), rotation.rotate_fast(qr)
    params = mx.array(np.array([scale, 1.0 / np.sqrt(np.float32(Dl)),
                                1.0 / np.sqrt(np.float32(Dr))], np.float32))
    nb = block_tables.shape[1]
    (out,) = _kernel()(
        inputs=[ql, qr, planes.l_codes, planes.l_scale, planes.r_codes, planes.r_scale,
                mx.array(block_tables.astype(np.int32)), mx.array(q_pos.astype(np.int32)),
                _lut(tier), params, mx.array(np.array([Q, H, nb], np.int32))],
        # compile-time: what is fixed for a pool; run-time: what changes per call
        template=[("TIER", _TIER_ID[tier.kind]), ("DL", Dl), ("DR", Dr),
                  ("BS", planes.l_codes.shape[1])],
        grid=(B * Q * H * _THREADS, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[(B * Q * H, Dl)], output_dtypes=[mx.float32])
    if tier.kind == "tq":
        out = rotation.unrotate_fast(out)
    return out.reshape(B, Q, H, Dl)


def unusable_reason(tier: Tier, Dl: int, Dr: int) -> str:
    """Why the op path serves a call (for the fallback log): no Metal, opted out, a shape
    the kernel does not take, or a failed self-check."""
    if not metal_available():
        return "no Metal device (MLX CPU backend)"
    if not metal_enabled():
        return "Metal kernels opted out (KVFLEET_METAL/COLI_METAL=0)"
    if not supported(tier, Dl, Dr):
        return f"{tier.name} with Dl={Dl}, Dr={Dr} is not a shape the Metal kernel takes"
    return "the Metal kernel failed its self-check (logged above)"


@lru_cache(maxsize=None)
def usable(tier_name: str, Dl: int, Dr: int, bs: int) -> bool:
    """True when Metal is on, the shape is supported and the kernel agrees with the op path
    on a hostile self-check problem (run once per key; the result is cached)."""
    tier = get_tier(tier_name)
    if not (metal_enabled() and supported(tier, Dl, Dr)):
        return False
    from kernels.cpu import codecs
    from kernels.metal.attention import paged_mla_attention as op_path
    rng = np.random.default_rng(0)
    lengths, H = [3 * bs + 1, 1, bs], 2
    nblk = sum(-(-n // bs) for n in lengths) + 2
    fill = np.nan if tier.kind == "f32" else 0xFF
    dt = np.dtype(tier.code_dtype())
    lc = np.full((nblk, bs, tier.code_width(Dl)), fill, dt)
    rc = np.full((nblk, bs, tier.code_width(Dr)), fill, dt)
    ls, rs = np.full((nblk, bs), np.nan, np.float32), np.full((nblk, bs), np.nan, np.float32)
    ids = rng.permutation(nblk)
    tables = np.full((len(lengths), 4), -1, np.int32)
    k = 0
    for b, n in enumerate(lengths):
        need = -(-n // bs)
        tables[b, :need] = ids[k:k + need]
        k += need
        t = np.arange(n)
        blk, off = tables[b, t // bs], t % bs
        L = rng.standard_normal((n, Dl)) + (1.0 if b == 2 else 0.0)  # row 2: L of mean 1
        lc[blk, off], ls[blk, off] = codecs.encode_rows(tier, L.astype(np.float32))
        rc[blk, off], rs[blk, off] = codecs.encode_rows(tier, rng.standard_normal((n, Dr)).astype(np.float32))
    planes = LayerPlanes(*(mx.array(a) for a in (lc, ls, rc, rs)))
    ql = rng.standard_normal((3, 2, H, Dl)).astype(np.float32)
    ql[2] = -1e30  # every score of row 2 about -Dl * 1e29, below any fixed floor
    qr = mx.array(rng.standard_normal((3, 2, H, Dr)).astype(np.float32))
    q_pos = np.array([[n - 1, n - 2] for n in lengths], np.int64)  # row 1: a padding query
    ql = mx.array(ql)
    want = np.array(op_path(tier, planes, tables, ql, qr, q_pos, 0.1, native=False))
    try:
        got = np.array(attend(tier, planes, tables, ql, qr, q_pos, 0.1))
    except Exception as e:  # a compile or launch error: logged, the op path serves instead
        log.error("metal: native attention kernel failed for %s Dl=%d Dr=%d bs=%d: %s; "
                  "using the MLX-op path", tier_name, Dl, Dr, bs, e)
        return False
    err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
    if not err <= 1e-5:
        log.error("metal: native attention kernel disagrees with the MLX-op path for %s "
                  "Dl=%d Dr=%d bs=%d (max rel err %.3g); using the op path", tier_name,
                  Dl, Dr, bs, err)
        return False
    return True
