"""The paged KV pool in device memory (CUDA, CuPy): kvstore/pool.py's planes on the GPU.

Same layout (LayerPlanes per layer: l_codes, l_scale, r_codes, r_scale over
[n_blocks, block_size]) and the same slot / block-table bookkeeping, which stays on the host
(inherited from KVPool); the device keeps a copy of the block tables, refreshed only when a
slot gains or loses blocks. Writes are encoded on the GPU (kernels/cuda/codecs.py, the same
bytes as the numpy codec); attend runs the fused CUDA kernel (kernels/cuda/attention.py).

Shadow contract: rows produced on the host (numpy L/R or coded rows read from disk) are
uploaded once, when written, and never again: attend moves no cached row across the bus.
Uploaded kv8 codes 0x7F / 0xFF (e4m3 NaN, which the contract decodes to 0) are stored as
0x00 (also 0), as the Hopper attention kernel converts codes in hardware.
`counters.rows_uploaded` / `bytes_uploaded` count every such upload (tests hold attend to
zero). A tier or width without a CUDA kernel (polar on CUDA; attention on a GPU whose shared
memory does not hold the smallest tile) falls back to the CPU codec / attention:
`counters.fallbacks[(op, tier)]` counts each call, and the first of each kind is logged at
WARNING -- never silent.
"""
from __future__ import annotations

import logging
from collections import Counter

import cupy as cp
import numpy as np

from kernels.cpu import codecs as cpu_codecs
from kernels.cpu.attention import LayerPlanes, used_blocks
from kernels.cuda import attention as cuda_attention
from kernels.cuda import codecs as cuda_codecs
from kvstore.pool import KVPool, attend_by_slot

log = logging.getLogger(__name__)


class DeviceCounters:
    """Transfers and CPU fallbacks of one DevicePool."""

    def __init__(self) -> None:
        self.rows_uploaded = 0
        self.bytes_uploaded = 0
        self.fallbacks: Counter = Counter()

    def upload(self, *arrays: np.ndarray) -> list[cp.ndarray]:
        """Copy host rows to the device, counting rows (first axis) and bytes."""
        out = []
        for a in arrays:
            a = np.ascontiguousarray(a)
            self.rows_uploaded += int(a.shape[0]) if a.ndim > 1 else 0
            self.bytes_uploaded += a.nbytes
            out.append(cp.asarray(a))
        return out

    def fallback(self, op: str, tier: str, why: str) -> None:
        key = (op, tier)
        if not self.fallbacks[key]:
            log.warning("CUDA %s for tier %s falls back to the CPU path: %s", op, tier, why)
        self.fallbacks[key] += 1

    def as_dict(self) -> dict:
        return {"rows_uploaded": self.rows_uploaded, "bytes_uploaded": self.bytes_uploaded,
                **{f"fallback_{op}_{tier}": n for (op, tier), n in self.fallbacks.items()}}


class DevicePool(KVPool):
    def __init__(self, n_layers: int, kv_lora: int, rope: int, tier, n_blocks: int,
                 block_size: int = 16, max_slots: int = 8,
                 max_blocks_per_slot: int | None = None):
        # The base class keeps slots, block tables and lengths on the host; it is built with
        # no layers so that it allocates no host planes, then the device planes go in.
        super().__init__(0, kv_lora, rope, tier, n_blocks, block_size, max_slots,
                         max_blocks_per_slot)
        self.n_layers = n_layers
        dt = np.dtype(self.tier.code_dtype())
        fill = np.nan if dt == np.float32 else 0xFF  # unwritten rows show up as NaN / 0xFF
        wl, wr = self.tier.code_width(kv_lora), self.tier.code_width(rope)
        self.planes = [
            LayerPlanes(l_codes=cp.full((n_blocks, block_size, wl), fill, dt),
                        l_scale=cp.full((n_blocks, block_size), np.nan, cp.float32),
                        r_codes=cp.full((n_blocks, block_size, wr), fill, dt),
                        r_scale=cp.full((n_blocks, block_size), np.nan, cp.float32))
            for _ in range(n_layers)]
        self.counters = DeviceCounters()
        self._tables_dev: cp.ndarray | None = None
        self._plan_key: bytes | None = None
        self._plan = None

    # -- block tables: host is the truth, the device copy follows ---------------------------
    def _allocate(self, slots: np.ndarray, need: np.ndarray) -> int:
        k = super()._allocate(slots, need)
        if k:
            self._tables_dev = None
        return k

    def truncate(self, slot: int, n: int) -> None:
        super().truncate(slot, n)
        self._tables_dev = None

    def device_tables(self) -> cp.ndarray:
        if self._tables_dev is None:
            self._tables_dev = cp.asarray(self.block_tables)
        return self._tables_dev

    # -- rows ----------------------------------------------------------------------------
    def write(self, layer: int, slots, positions, L, R) -> None:
        """Encode rows L [N, kv_lora], R [N, rope] (numpy: uploaded once, counted; cupy:
        already on the device) on the GPU and store them at (slot, position)."""
        slots, positions, _ = self._write_args(layer, slots, positions, False, (L, R))
        if not cuda_codecs.has_encoder(self.tier):
            self.counters.fallback("encode", self.tier.name, "no CUDA encoder for this tier")
            L = L.get() if isinstance(L, cp.ndarray) else L
            R = R.get() if isinstance(R, cp.ndarray) else R
            lc, ls = cpu_codecs.encode_rows(self.tier, np.asarray(L, np.float32))
            rc, rs = cpu_codecs.encode_rows(self.tier, np.asarray(R, np.float32))
            self._put(layer, slots, positions, lc, ls, rc, rs)
            return
        if not isinstance(L, cp.ndarray):
            (L,) = self.counters.upload(np.asarray(L, np.float32))
        if not isinstance(R, cp.ndarray):
            (R,) = self.counters.upload(np.asarray(R, np.float32))
        lc, ls = cuda_codecs.encode_rows(self.tier, cp.ascontiguousarray(L, cp.float32))
        rc, rs = cuda_codecs.encode_rows(self.tier, cp.ascontiguousarray(R, cp.float32))
        self._store(layer, slots, positions, lc, ls, rc, rs)

    def _put(self, layer: int, slots, positions, l_codes, l_scale, r_codes, r_scale) -> None:
        """KVPool._put (what write_coded stores): host arrays are uploaded once."""
        arrs = [l_codes, l_scale, r_codes, r_scale]
        host = [i for i, a in enumerate(arrs) if not isinstance(a, cp.ndarray)]
        for i, dev in zip(host, self.counters.upload(*[arrs[i] for i in host])):
            arrs[i] = dev
        if self.tier.kind == "fp8":
            # e4m3 NaN codes decode to 0, as 0x00 does; the sm_90a kernel converts codes in
            # hardware (NaN stays NaN), so live rows hold the canonical 0x00 instead
            for i in (0, 2):
                c = arrs[i]
                arrs[i] = cp.where((c & 0x7F) == 0x7F, cp.uint8(0), c).astype(cp.uint8)
        self._store(layer, slots, positions, *arrs)

    def _store(self, layer, slots, positions, lc, ls, rc, rs) -> None:
        blk, off = self._where(slots, positions)
        blk_d, off_d = cp.asarray(blk), cp.asarray(off)
        p = self.planes[layer]
        p.l_codes[blk_d, off_d] = lc
        p.l_scale[blk_d, off_d] = ls
        p.r_codes[blk_d, off_d] = rc
        p.r_scale[blk_d, off_d] = rs
        np.maximum.at(self.lengths, slots, positions + 1)

    def read_rows(self, slot: int, layer: int, start: int = 0, end: int | None = None):
        """Coded rows [start, end) of a slot, downloaded to the host (for disk I/O)."""
        self._check_layer(layer)
        pos = self._span(slot, start, end)  # (KVPool's bounds: never another slot's block)
        blk = cp.asarray(self.block_tables[slot, pos // self.block_size])
        off = cp.asarray(pos % self.block_size)
        p = self.planes[layer]
        return (p.l_codes[blk, off].get(), p.l_scale[blk, off].get(),
                p.r_codes[blk, off].get(), p.r_scale[blk, off].get())

    # -- attention -------------------------------------------------------------------------
    def plan(self, slots, positions, n_heads: int) -> cuda_attention.DecodePlan:
        """The kernel's work split for this step; cached, so all layers of a step share it."""
        slots = np.asarray(slots, np.int64)
        positions = np.asarray(positions, np.int64)
        key = slots.tobytes() + b"|" + positions.tobytes() + b"|" + np.int64(n_heads).tobytes()
        if key != self._plan_key:
            widths = (self.tier, n_heads, self.kv_lora, self.rope, self.block_size)
            self._plan = cuda_attention.decode_plan(
                slots, positions, ctas_per_sm=cuda_attention.ctas_per_sm(*widths),
                head_groups=cuda_attention.head_groups(*widths))
            self._plan_key = key
        return self._plan

    def attend(self, layer: int, slots, positions, q_lat, q_rope, scale: float):
        """ctx [N, H, kv_lora] for queries at (slot, position) over keys 0..position.
        cupy queries give a cupy result, numpy queries a numpy one."""
        on_host = not isinstance(q_lat, cp.ndarray)
        slots, positions = self._attend_args(layer, slots, positions, q_lat, q_rope)
        why = cuda_attention.no_kernel_reason(self.tier, self.kv_lora, self.rope)
        if why is not None:  # (a polar tier, the widths, or too little shared memory)
            self.counters.fallback("attend", self.tier.name, why)
            ctx = self._cpu_attend(layer, slots, positions, q_lat, q_rope, scale)
            return ctx if on_host else cp.asarray(ctx)
        ql = cp.ascontiguousarray(cp.asarray(q_lat, cp.float32))
        qr = cp.ascontiguousarray(cp.asarray(q_rope, cp.float32))
        ctx = cuda_attention.paged_mla_decode(self.tier, self.planes[layer], self.device_tables(),
                                              self.plan(slots, positions, ql.shape[1]), ql, qr,
                                              scale)
        return ctx.get() if on_host else ctx

    def _cpu_attend(self, layer, slots, positions, q_lat, q_rope, scale) -> np.ndarray:
        """The numpy attention over a host copy of the blocks these slots use, grouped per
        slot as KVPool.attend groups them (kvstore.pool.attend_by_slot)."""
        def rows_of(uniq):
            blocks, host_tables = used_blocks(self.block_tables[uniq], self.n_blocks)  # [B, nb]
            p, b = self.planes[layer], cp.asarray(blocks)
            return LayerPlanes(p.l_codes[b].get(), p.l_scale[b].get(), p.r_codes[b].get(),
                               p.r_scale[b].get()), host_tables
        ql = q_lat.get() if isinstance(q_lat, cp.ndarray) else np.asarray(q_lat, np.float32)
        qr = q_rope.get() if isinstance(q_rope, cp.ndarray) else np.asarray(q_rope, np.float32)
        return attend_by_slot(self.tier, rows_of, slots, positions, ql, qr, scale, self.rebuilds)

    def metrics(self) -> dict:
        return {"bytes_in_use": self.bytes_in_use(), **self.counters.as_dict()}
