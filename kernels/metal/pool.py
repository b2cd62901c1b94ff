"""The paged KV pool with its planes as MLX arrays (unified memory on a Mac), for `metal`
workers. Slot and block bookkeeping (alloc/free/truncate/lengths/block tables, byte
accounting) is kvstore.pool.KVPool's, inherited unchanged; this class only replaces where
the planes live, how rows are encoded (kernels/metal/codecs.py, bit-identical to numpy)
and how a layer is attended (kernels/metal/attention.py). The polar tiers have neither an
MLX codec nor an MLX attention: both run the numpy reference on host copies, each call
counted in `stats.fallback` (the first logged), as DevicePool does on CUDA.

Plane layout is KVPool's (see kvstore/pool.py): per layer LayerPlanes of mx arrays
l_codes [n_blocks, bs, wL], l_scale [n_blocks, bs], r_codes [n_blocks, bs, wR],
r_scale [n_blocks, bs]; fresh planes hold NaN (f32) / 0xFF codes and NaN scales.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels.cpu.attention import LayerPlanes
from kernels.metal import attention, codecs
from kernels.metal.backend import KernelStats
from kvstore.pool import KVPool, group_by_slot


class MLXKVPool(KVPool):
    def __init__(self, n_layers: int, kv_lora: int, rope: int, tier, n_blocks: int,
                 block_size: int = 16, max_slots: int = 8,
                 max_blocks_per_slot: int | None = None, stats: KernelStats | None = None):
        # KVPool builds the bookkeeping; zero layers so that it allocates no numpy planes
        super().__init__(0, kv_lora, rope, tier, n_blocks, block_size, max_slots,
                         max_blocks_per_slot)
        self.n_layers = n_layers
        self.stats = stats if stats is not None else KernelStats()
        dt = mx.float32 if self.tier.code_dtype() == "float32" else mx.uint8
        fill = float("nan") if dt == mx.float32 else 0xFF
        self.planes = [
            LayerPlanes(
                l_codes=mx.full((n_blocks, block_size, self.tier.code_width(kv_lora)), fill, dt),
                l_scale=mx.full((n_blocks, block_size), float("nan"), mx.float32),
                r_codes=mx.full((n_blocks, block_size, self.tier.code_width(rope)), fill, dt),
                r_scale=mx.full((n_blocks, block_size), float("nan"), mx.float32))
            for _ in range(n_layers)]
        mx.eval([(p.l_codes, p.l_scale, p.r_codes, p.r_scale) for p in self.planes])

    def write(self, layer: int, slots, positions, L, R) -> None:
        """Encode rows L [N, kv_lora] and R [N, rope] (mx or numpy) and store them."""
        slots, positions, _ = self._write_args(layer, slots, positions, False, (L, R))
        l_codes, l_scale = codecs.encode_rows(self.tier, L, self.stats)
        r_codes, r_scale = codecs.encode_rows(self.tier, R, self.stats)
        self._put(layer, slots, positions, l_codes, l_scale, r_codes, r_scale)

    def _put(self, layer: int, slots, positions, l_codes, l_scale, r_codes, r_scale) -> None:
        """KVPool._put into the mx planes, evaluated at once, so that the planes never
        carry a graph and the scatter reuses their buffers."""
        blk, off = self._where(slots, positions)
        blk, off = mx.array(blk.astype(np.int32)), mx.array(off.astype(np.int32))
        p = self.planes[layer]
        p.l_codes[blk, off] = codecs.as_mx(l_codes)
        p.l_scale[blk, off] = codecs.as_mx(l_scale)
        p.r_codes[blk, off] = codecs.as_mx(r_codes)
        p.r_scale[blk, off] = codecs.as_mx(r_scale)
        mx.eval(p.l_codes, p.l_scale, p.r_codes, p.r_scale)
        np.maximum.at(self.lengths, slots, positions + 1)

    def read_rows(self, slot: int, layer: int, start: int = 0, end: int | None = None):
        """Coded rows [start, end) of a slot as numpy arrays (for the disk formats)."""
        self._check_layer(layer)
        pos = self._span(slot, start, end)  # (KVPool's bounds: never another slot's block)
        blk = mx.array(self.block_tables[slot, pos // self.block_size].astype(np.int32))
        off = mx.array((pos % self.block_size).astype(np.int32))
        p = self.planes[layer]
        return tuple(np.array(a[blk, off]) for a in (p.l_codes, p.l_scale, p.r_codes, p.r_scale))

    def attend(self, layer: int, slots, positions, q_lat, q_rope, scale: float) -> mx.array:
        """As KVPool.attend, on mx arrays: q_lat [N, H, kv_lora], q_rope [N, H, rope] ->
        ctx [N, H, kv_lora] (an mx array). Each slot must be allocated and hold the rows up
        to each of its query positions."""
        slots, positions = self._attend_args(layer, slots, positions, q_lat, q_rope)
        N, H, Dl = q_lat.shape
        if N == 0:  # (MLX's scatter refuses the empty updates below)
            return mx.zeros((0, H, Dl), mx.float32)
        uniq, inv, rank, q_pos = group_by_slot(slots, positions)
        B, Q = q_pos.shape
        inv_m, rank_m = mx.array(inv.astype(np.int32)), mx.array(rank.astype(np.int32))
        ql = mx.zeros((B, Q, H, Dl), mx.float32)
        qr = mx.zeros((B, Q, H, q_rope.shape[-1]), mx.float32)
        ql[inv_m, rank_m] = codecs.as_mx(q_lat)
        qr[inv_m, rank_m] = codecs.as_mx(q_rope)
        ctx = attention.paged_mla_attention(self.tier, self.planes[layer],
                                            self.block_tables[uniq], ql, qr, q_pos, scale,
                                            stats=self.stats, rebuilds=self.rebuilds)
        return ctx[inv_m, rank_m]
