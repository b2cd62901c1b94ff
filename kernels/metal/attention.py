"""Paged MLA attention on MLX arrays (absorbed form) for the f32, kv8 and tq4 tiers; the
polar tiers, which have no MLX attention, go through the numpy reference.

Same contract as kernels/cpu/attention.py: planes = LayerPlanes of mx arrays
(l_codes [nblk, bs, wL], l_scale [nblk, bs], r_codes [nblk, bs, wR], r_scale [nblk, bs]),
block_tables [B, nb] (-1 = no block), q_lat [B, Q, H, Dl], q_rope [B, Q, H, Dr],
q_pos [B, Q] (-1 = padding query, output 0); key t of row b is visible to query q iff
t <= q_pos[b, q]. Returns ctx [B, Q, H, Dl] float32.

The keys are read in chunks of blocks (`chunk_tokens`) with an online softmax, so at most
one chunk of rows is ever expanded to float32 -- never the whole cache. Per chunk, each
tier turns its codes into unscaled values V [B, Tc, n] plus one multiplier w [B, Tc]:

    f32   V = the rows, w = 1
    kv8   V = e4m3 value of the byte, w = the row's scale            (score = (q.V) w, ctx += (p w) V)
    tq4   V = the codebook levels, w = radius/sqrtf(n)        in the ROTATED domain: q is
          rotated once per call, the context is accumulated rotated and unrotated once

Positions outside a row's keys get w = 0 (and V = 0 for f32, whose garbage may be NaN), so
pool garbage never reaches a sum. Where Metal is on, a hand-written kernel
(kernels/metal/native.py, guarded by a self-check) serves the call instead; every call the
op path serves is counted in `stats.fallback["paged_attention"]` (see backend.py).

Polar tiers: the blocks the call can see are copied to host numpy arrays (on a Mac that
memory is the GPU's too) and kernels/cpu/attention.py attends them; each such call is counted
in `stats.fallback["paged_attention_<tier>"]` and the first one is logged, as the CUDA pool
does for polar (a fleet shares one tier, so a Mac node runs what its peers run, slower).
"""
from __future__ import annotations

import logging
import math

import mlx.core as mx
import numpy as np

from kernels.cpu import attention as cpu_attention
from kernels.cpu.attention import LayerPlanes, plane_shapes
from kernels.cpu.rotation import rotatable
from kernels.metal import native as metal_native
from kernels.metal import rotation, tq4
from kernels.metal.backend import KernelStats
from kernels.tiers import Tier, TierError, get_tier

SUPPORTED = ("f32", "fp8", "tq")
_FLOOR = float(np.finfo(np.float32).min)  # the masked-out score: no finite score is below it


def _values(tier: Tier, codes: mx.array, scale: mx.array, valid: mx.array, n: int):
    """A chunk of coded rows -> (V [B, Tc, n] f32 unscaled values, w [B, Tc] multipliers)."""
    zero = mx.array(0.0, mx.float32)
    if tier.kind == "f32":
        return mx.where(valid[..., None], codes, zero), valid.astype(mx.float32)
    if tier.kind == "fp8":  # MLX's e4m3 conversion is the table except 0x7F/0xFF (NaN -> 0)
        nan_code = (codes & 0x7F) == 0x7F
        v = mx.from_fp8(mx.where(nan_code, mx.array(0, mx.uint8), codes), mx.float32)
        return v, mx.where(valid, scale, zero)
    if not rotatable(n):  # a width tq4 cannot rotate is stored inert: contributes nothing
        return mx.zeros((*codes.shape[:-1], n), mx.float32), mx.zeros(valid.shape, mx.float32)
    return tq4.unpack_levels(codes), mx.where(valid, tq4.step(scale, n), zero)


def _chunk(tier, planes, idx, valid, ql_t, qr_t, qmask, scale, state):
    """One chunk of the online softmax. idx [B, C] block ids, valid [B, C*bs] key mask,
    qmask [B, Q, C*bs] causal mask; state = (m [B, QH, 1], l [B, QH, 1], acc [B, QH, Dl])."""
    B, C = idx.shape
    bs = planes.l_codes.shape[1]
    Dl, Dr = ql_t.shape[1], qr_t.shape[1]
    lc = planes.l_codes[idx].reshape(B, C * bs, -1)
    rc = planes.r_codes[idx].reshape(B, C * bs, -1)
    vl, wl = _values(tier, lc, planes.l_scale[idx].reshape(B, C * bs), valid, Dl)
    vr, wr = _values(tier, rc, planes.r_scale[idx].reshape(B, C * bs), valid, Dr)
    # ql_t/qr_t are the queries transposed to [B, n, QH], contiguous: rows @ q^T is the GEMM
    # layout that runs fastest (about 2x on the CPU backend's BLAS); the [B, Tc, QH] result
    # is small, so transposing it back costs little
    s_t = (vl @ ql_t) * wl[:, :, None] + (vr @ qr_t) * wr[:, :, None]  # [B, Tc, QH]
    s = mx.contiguous(s_t.swapaxes(1, 2))
    s = s * scale  # [B, QH, Tc]
    QH, Q = ql_t.shape[2], qmask.shape[1]
    mask = mx.broadcast_to(qmask[:, :, None, :], (B, Q, QH // Q, C * bs)).reshape(B, QH, -1)
    m, l, acc = state
    # a finite floor instead of -inf, and p masked explicitly: no inf arithmetic, so fast
    # math (which may assume finite values) cannot change the result. The running max only
    # counts once a row has seen a key (l > 0): a floor taken as a real max would put a row
    # whose every score is below it to exp(s - floor) = 0, the zeros of a padding query
    seen = l > 0
    c_max = mx.maximum(mx.max(mx.where(mask, s, _FLOOR), axis=-1, keepdims=True), _FLOOR)
    m_new = mx.where(seen, mx.maximum(m, c_max), c_max)
    alpha = mx.exp(mx.where(seen, m, m_new) - m_new)  # 1 where l and acc are still 0
    p = mx.where(mask, mx.exp(s - m_new), mx.array(0.0, mx.float32))
    l = l * alpha + mx.sum(p, axis=-1, keepdims=True)
    acc = acc * alpha + (p * wl[:, None, :]) @ vl
    return m_new, l, acc


def _check_planes(tier: Tier, planes: LayerPlanes, Dl: int, Dr: int) -> None:
    """The four planes share [n_blocks, bs] and hold the tier's dtypes: the gathers below
    (and the native kernel) index them without bounds checks, so a plane with fewer blocks
    or int codes past 255 would read out of bounds."""
    code_dt = mx.float32 if tier.code_dtype() == "float32" else mx.uint8
    for name, shape in plane_shapes(tier, planes, Dl, Dr).items():
        dt = code_dt if name.endswith("codes") else mx.float32
        a = getattr(planes, name)
        if tuple(a.shape) != shape or a.dtype != dt:
            raise ValueError(f"planes.{name} is {a.dtype} {tuple(a.shape)}; tier {tier.name} "
                             f"with Dl={Dl}, Dr={Dr} needs {dt} {shape}")


def _visible_tables(block_tables: np.ndarray, n_keys: np.ndarray, bs: int,
                    n_blocks: int) -> np.ndarray:
    """The table entries some visible key lies in, others set to -1: padding past a row's
    keys may hold anything (an out-of-range sentinel included) and is never gathered, as in
    the numpy path. A visible entry past the pool's blocks is an error naming it."""
    need = np.arange(block_tables.shape[1])[None, :] * bs < n_keys[:, None]  # [B, nb]
    bad = np.argwhere(need & (block_tables >= n_blocks))
    if len(bad):
        b, j = (int(v) for v in bad[0])
        raise ValueError(f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is not a block "
                         f"of the planes ({n_blocks} blocks); row {b} sees {int(n_keys[b])} "
                         f"keys, so its entries 0..{-(-int(n_keys[b]) // bs) - 1} are read")
    return np.where(need & (block_tables >= 0), block_tables, -1).astype(np.int32)


def paged_mla_attention(tier: Tier | str, planes: LayerPlanes, block_tables, q_lat: mx.array,
                        q_rope: mx.array, q_pos, scale: float, *,
                        stats: KernelStats | None = None, chunk_tokens: int = 2048,
                        native: bool = True, rebuilds=None) -> mx.array:
    """Absorbed MLA attention through block tables on MLX arrays; see the module docstring.
    With `native` (the default) the hand-written Metal kernel serves the call where it is
    usable (kernels/metal/native.py); otherwise the MLX-op path does, counted in `stats`.
    A polar tier goes through the numpy reference (counted in `stats`); `rebuilds` (a
    consumers.WorkCounter, required then) counts the rows it rebuilds to float32."""
    tier = get_tier(tier)
    if tier.kind not in SUPPORTED and tier.kind != "polar":
        raise TierError(f"{tier.name}: no MLX attention for kind {tier.kind!r}; "
                        f"use one of f32, kv8, tq4 or a polar tier")
    q_pos = np.asarray(q_pos, np.int64)
    block_tables = np.asarray(block_tables, np.int32)
    B, Q, H, Dl = q_lat.shape
    Dr = q_rope.shape[-1]
    if (q_pos.shape != (B, Q) or tuple(q_rope.shape[:3]) != (B, Q, H)
            or block_tables.ndim != 2 or block_tables.shape[0] != B):
        raise ValueError(f"shape mismatch: q_lat {tuple(q_lat.shape)} q_rope "
                         f"{tuple(q_rope.shape)} q_pos {q_pos.shape} block_tables "
                         f"{block_tables.shape} for tier {tier.name}")
    _check_planes(tier, planes, Dl, Dr)  # (the planes against each other and these widths)
    bs = planes.l_codes.shape[1]
    n_keys = q_pos.max(axis=1, initial=-1) + 1  # [B] keys each row can see at most
    block_tables = _visible_tables(block_tables, n_keys, bs, planes.l_codes.shape[0])
    if tier.kind not in SUPPORTED:
        return _numpy_attention(tier, planes, block_tables, q_lat, q_rope, q_pos, scale,
                                stats, rebuilds)
    if native and metal_native.usable(tier.name, Dl, Dr, bs):
        if stats is not None:
            stats.count_native("paged_attention")
        return metal_native.attend(tier, planes, block_tables, q_lat, q_rope, q_pos, scale)
    if stats is not None:
        stats.count_fallback("paged_attention", metal_native.unusable_reason(tier, Dl, Dr))
    t_max = int(n_keys.max(initial=0))
    if t_max <= 0:
        return mx.zeros((B, Q, H, Dl), mx.float32)
    n_blk = min(math.ceil(t_max / bs), block_tables.shape[1])
    per = max(1, chunk_tokens // bs)

    ql = q_lat.astype(mx.float32).reshape(B, Q * H, Dl)
    qr = q_rope.astype(mx.float32).reshape(B, Q * H, Dr)
    rot_l = tier.kind == "tq" and rotatable(Dl)
    if rot_l:
        ql = rotation.rotate_fast(ql)
    if tier.kind == "tq" and rotatable(Dr):
        qr = rotation.rotate_fast(qr)
    ql_t, qr_t = mx.contiguous(ql.swapaxes(1, 2)), mx.contiguous(qr.swapaxes(1, 2))
    qp = mx.array(q_pos.astype(np.int32))
    state = (mx.full((B, Q * H, 1), _FLOOR, mx.float32), mx.zeros((B, Q * H, 1), mx.float32),
             mx.zeros((B, Q * H, Dl), mx.float32))
    for c0 in range(0, n_blk, per):
        bt = block_tables[:, c0:min(c0 + per, n_blk)]  # [B, C]
        t = np.arange(c0 * bs, (c0 + bt.shape[1]) * bs)
        valid = np.repeat(bt >= 0, bs, axis=1) & (t[None, :] < n_keys[:, None])  # [B, Tc]
        qmask = mx.array(valid)[:, None, :] & (mx.array(t.astype(np.int32))[None, None, :]
                                               <= qp[:, :, None])
        state = _chunk(tier, planes, mx.array(np.maximum(bt, 0)), mx.array(valid), ql_t, qr_t,
                       qmask, scale, state)
    _, l, acc = state
    ctx = acc / mx.where(l > 0, l, mx.array(1.0, mx.float32))  # l = 0: padding query -> 0
    if rot_l:
        ctx = rotation.unrotate_fast(ctx)
    return ctx.reshape(B, Q, H, Dl)


def _numpy_attention(tier: Tier, planes: LayerPlanes, block_tables: np.ndarray, q_lat, q_rope,
                     q_pos: np.ndarray, scale: float, stats: KernelStats | None,
                     rebuilds) -> mx.array:
    """kernels/cpu/attention.py over host copies of the blocks some visible key lies in
    (block_tables as _visible_tables leaves it: -1 elsewhere), renumbered 0..k-1."""
    if rebuilds is None:
        raise ValueError(f"{tier.name}: the numpy attention of a polar tier needs `rebuilds` "
                         f"(a consumers.WorkCounter for the rows it rebuilds)")
    if stats is not None:
        stats.count_fallback(f"paged_attention_{tier.name}",
                             "no MLX attention for this tier; numpy attention", logging.WARNING)
    blocks, tables = cpu_attention.used_blocks(block_tables, planes.l_codes.shape[0])
    idx = mx.array(blocks.astype(np.int32))
    host = LayerPlanes(*(np.array(getattr(planes, f)[idx])
                         for f in ("l_codes", "l_scale", "r_codes", "r_scale")))
    ctx = cpu_attention.paged_mla_attention(
        tier, host, tables, np.array(q_lat.astype(mx.float32)),
        np.array(q_rope.astype(mx.float32)), q_pos, scale, counter=rebuilds)
    return mx.array(ctx)
