"""Paged MLA attention on the CPU (numpy), absorbed form, any KV tier.

Per layer the pool holds four planes (see kvstore/pool.py):

    l_codes [n_blocks, block_size, wL]   L rows (kv_lora latent) in the tier's code layout
    l_scale [n_blocks, block_size]       float32 scale per L row
    r_codes [n_blocks, block_size, wR]   R rows (rope key) in the tier's code layout
    r_scale [n_blocks, block_size]       float32 scale per R row

Token t of a slot lives at block block_table[t // block_size], offset t % block_size.
A call attends B independent rows (slots) at once, each with Q queries (a decode step has
Q = 1 and many slots; a prefill chunk has one slot and many queries):

    score[b, q, h, t] = (q_lat[b,q,h] . L_t + q_rope[b,q,h] . R_t) * scale,  t <= q_pos[b, q]
    ctx[b, q, h]      = sum_t softmax_t(score) * L_t

Unused pool positions may hold anything (NaN included); they are never read into a sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.cpu import consumers
from kernels.tiers import Tier, get_tier


@dataclass
class LayerPlanes:
    l_codes: np.ndarray
    l_scale: np.ndarray
    r_codes: np.ndarray
    r_scale: np.ndarray


def gather_rows(codes: np.ndarray, scale: np.ndarray, block_tables: np.ndarray,
                n_keys: np.ndarray, t_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows 0..t_max-1 of each slot through its block table -> codes [B, t_max, w],
    scales [B, t_max] and the validity mask [B, t_max] (t < n_keys[b]). Invalid positions
    come back as code 0, scale 0, so consumers never see garbage."""
    bs = codes.shape[1]
    t = np.arange(t_max)
    valid = t[None, :] < n_keys[:, None]  # [B, T]
    in_table = t // bs < block_tables.shape[1]
    blk = block_tables[:, np.where(in_table, t // bs, 0)]  # [B, T]
    valid &= in_table[None, :] & (blk >= 0)
    if valid.any() and int(blk[valid].max()) >= codes.shape[0]:
        b, j = np.argwhere(valid & (blk >= codes.shape[0]))[0]
        raise ValueError(f"block_tables[{b}, {j // bs}] = {blk[b, j]} is past the pool's "
                         f"{codes.shape[0]} blocks")
    flat = np.where(valid, blk * bs + t % bs, 0)
    g_codes = codes.reshape(-1, codes.shape[-1])[flat]
    g_scale = scale.reshape(-1)[flat]
    g_codes[~valid] = 0
    g_scale = np.where(valid, g_scale, np.float32(0))
    return g_codes, g_scale, valid


def used_blocks(block_tables: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(the block ids the tables use, sorted; the tables renumbered onto them, -1 kept): for
    attending host copies of only those blocks (a backend without a kernel for the tier)."""
    blocks = np.unique(block_tables[block_tables >= 0])
    remap = np.full(n_blocks, -1, np.int32)
    remap[blocks] = np.arange(len(blocks), dtype=np.int32)
    return blocks, np.where(block_tables >= 0, remap[np.maximum(block_tables, 0)], -1).astype(np.int32)


def plane_shapes(tier: Tier, planes: LayerPlanes, Dl: int, Dr: int) -> dict:
    """Each plane's expected shape, from l_codes' [n_blocks, bs] and the query widths."""
    nb_bs = tuple(planes.l_codes.shape[:2])
    return {"l_codes": (*nb_bs, tier.code_width(Dl)), "l_scale": nb_bs,
            "r_codes": (*nb_bs, tier.code_width(Dr)), "r_scale": nb_bs}


def _check_planes(tier: Tier, planes: LayerPlanes, Dl: int, Dr: int) -> None:
    """The four planes agree with each other and with the query widths (a width mismatch
    would otherwise decode the codes at the wrong row width: garbage, or an inert width's
    zeros, without an error)."""
    tier = get_tier(tier)
    for name, shape in plane_shapes(tier, planes, Dl, Dr).items():
        got = getattr(planes, name).shape
        if got != shape:
            raise ValueError(f"{tier.name}: planes.{name} has shape {got}, expected {shape} "
                             f"for q_lat width {Dl} and q_rope width {Dr}")


def paged_mla_attention(tier: Tier, planes: LayerPlanes, block_tables: np.ndarray,
                        q_lat: np.ndarray, q_rope: np.ndarray, q_pos: np.ndarray,
                        scale: float, counter=None) -> np.ndarray:
    """Absorbed MLA attention through block tables. Shapes: block_tables [B, nb] int32
    (-1 = no block), q_lat [B, Q, H, Dl], q_rope [B, Q, H, Dr], q_pos [B, Q] int (-1 marks a
    padding query, whose output is zero). Returns ctx [B, Q, H, Dl] float32 (the latent
    context; the caller applies W_UV). `counter` (a consumers.WorkCounter) counts the rows
    that polar tiers rebuild; it is required for them."""
    B, Q, H, Dl = q_lat.shape
    Dr = q_rope.shape[-1]
    if q_pos.shape != (B, Q) or q_rope.shape[:3] != (B, Q, H) or block_tables.shape[0] != B:
        raise ValueError(f"shape mismatch: {q_lat.shape=} {q_rope.shape=} {q_pos.shape=} "
                         f"{block_tables.shape=}")
    _check_planes(tier, planes, Dl, Dr)
    n_keys = q_pos.max(axis=1, initial=-1).astype(np.int64) + 1  # [B]; keys a row can see at most
    t_max = int(n_keys.max(initial=0))
    if t_max <= 0:
        return np.zeros((B, Q, H, Dl), np.float32)
    capacity = block_tables.shape[1] * planes.l_codes.shape[1]
    if t_max > capacity:
        b = int(np.argmax(n_keys))
        raise ValueError(f"q_pos[{b}] reaches position {t_max - 1}, past the {capacity} tokens "
                         f"that block_tables {block_tables.shape} x block_size "
                         f"{planes.l_codes.shape[1]} can hold")
    l_c, l_s, valid = gather_rows(planes.l_codes, planes.l_scale, block_tables, n_keys, t_max)
    r_c, r_s, _ = gather_rows(planes.r_codes, planes.r_scale, block_tables, n_keys, t_max)

    ql = q_lat.reshape(B, Q * H, Dl).astype(np.float32, copy=False)
    qr = q_rope.reshape(B, Q * H, Dr).astype(np.float32, copy=False)
    s = (consumers.scores(tier, ql, l_c, l_s, counter)
         + consumers.scores(tier, qr, r_c, r_s, counter))
    s = s.reshape(B, Q, H, t_max) * np.float32(scale)

    t = np.arange(t_max)
    mask = (t[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [B, Q, T]
    s = np.where(mask[:, :, None, :], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    # zeros only for rows that see no key; a NaN query's NaN denominator stays NaN (as on
    # the GPU and MLX paths), not a silent row of zeros
    p = np.divide(p, denom, out=np.zeros_like(p), where=denom != 0)
    ctx = consumers.context(tier, p.reshape(B, Q * H, t_max).astype(np.float32), l_c, l_s, Dl,
                            counter)
    return ctx.reshape(B, Q, H, Dl).astype(np.float32, copy=False)
