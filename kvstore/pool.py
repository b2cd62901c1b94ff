"""The paged KV pool in host memory: blocks, slots, block tables, one set of planes per layer.

Layout (per layer, see kernels/cpu/attention.py LayerPlanes):
    l_codes [n_blocks, block_size, tier.code_width(kv_lora)]  tier.code_dtype()
    l_scale [n_blocks, block_size]                            float32
    r_codes [n_blocks, block_size, tier.code_width(rope)]     tier.code_dtype()
    r_scale [n_blocks, block_size]                            float32

A slot owns a list of blocks (its block table row, -1 past the end) and a length (tokens
written). Blocks are taken from a free list when a write reaches past the slot's capacity
and given back when the slot is freed or truncated. Fresh planes are filled with NaN
(f32) / 0xFF codes and NaN scales, so a read of an unwritten position shows up in tests.
"""
from __future__ import annotations

import math

import numpy as np

from kernels.cpu import codecs
from kernels.cpu.attention import LayerPlanes, paged_mla_attention
from kernels.cpu.consumers import WorkCounter
from kernels.tiers import Tier, get_tier


def group_by_slot(slots: np.ndarray, positions: np.ndarray):
    """A flat token batch -> (unique slots [B], row of each token [N], its index within
    the row [N], q_pos [B, Q] with -1 padding): one attention row per slot. An empty batch
    gives B = Q = 0."""
    uniq, inv, counts = np.unique(slots, return_inverse=True, return_counts=True)
    order = np.argsort(inv, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order)) - starts[inv[order]]
    q_pos = np.full((len(uniq), int(counts.max(initial=0))), -1, np.int64)
    q_pos[inv, rank] = positions
    return uniq, inv, rank, q_pos


def attend_by_slot(tier: Tier, rows_of, slots: np.ndarray, positions: np.ndarray,
                   q_lat: np.ndarray, q_rope: np.ndarray, scale: float,
                   counter: WorkCounter | None = None) -> np.ndarray:
    """The numpy attention of a flat token batch, one row per slot (group_by_slot):
    `rows_of(unique slots)` gives (LayerPlanes, block tables [B, nb] into them). KVPool and
    DevicePool's CPU fallback both attend through here, so the two give the same bits for
    the same rows (the same shapes, hence the same float32 sums on any CPU)."""
    uniq, inv, rank, qp = group_by_slot(slots, positions)
    B, Q = qp.shape
    N, H, Dl = q_lat.shape
    ql = np.zeros((B, Q, H, Dl), np.float32)
    qr = np.zeros((B, Q, H, q_rope.shape[-1]), np.float32)
    ql[inv, rank] = q_lat
    qr[inv, rank] = q_rope
    planes, tables = rows_of(uniq)
    ctx = paged_mla_attention(tier, planes, tables, ql, qr, qp, scale, counter=counter)
    return ctx[inv, rank]


class PoolFullError(RuntimeError):
    """No free slot, or no free block for a slot's next tokens."""


class KVPool:
    def __init__(self, n_layers: int, kv_lora: int, rope: int, tier: Tier | str,
                 n_blocks: int, block_size: int = 16, max_slots: int = 8,
                 max_blocks_per_slot: int | None = None):
        if n_blocks <= 0 or block_size <= 0 or max_slots <= 0:
            raise ValueError(f"{n_blocks=}, {block_size=} and {max_slots=} must be positive")
        self.tier = get_tier(tier)
        why = self.tier.width_error(kv_lora, rope)
        if why:  # (the codecs store such rows as inert zeros: a pool of them would attend to nothing)
            raise ValueError(why)
        self.n_layers, self.kv_lora, self.rope = n_layers, kv_lora, rope
        self.block_size, self.n_blocks, self.max_slots = block_size, n_blocks, max_slots
        nb = max_blocks_per_slot or n_blocks
        dt = np.dtype(self.tier.code_dtype())
        fill = np.nan if dt == np.float32 else 0xFF
        self.planes = [
            LayerPlanes(
                l_codes=np.full((n_blocks, block_size, self.tier.code_width(kv_lora)), fill, dt),
                l_scale=np.full((n_blocks, block_size), np.nan, np.float32),
                r_codes=np.full((n_blocks, block_size, self.tier.code_width(rope)), fill, dt),
                r_scale=np.full((n_blocks, block_size), np.nan, np.float32))
            for _ in range(n_layers)]
        self.block_tables = np.full((max_slots, nb), -1, np.int32)
        self.lengths = np.zeros(max_slots, np.int64)
        self._used = np.zeros(max_slots, bool)
        self._free_blocks = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.rebuilds = WorkCounter()  # polar rows the attention had to rebuild to float32

    @classmethod
    def for_model(cls, cfg, tier: Tier | str, slots: int, max_ctx: int,
                  block_size: int = 16) -> "KVPool":
        """A pool with room for `slots` slots of `max_ctx` tokens each for a ModelConfig."""
        per_slot = math.ceil(max_ctx / block_size)
        return cls(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, tier,
                   n_blocks=slots * per_slot, block_size=block_size, max_slots=slots,
                   max_blocks_per_slot=per_slot)

    # -- slots ------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.block_tables.shape[1] * self.block_size

    def alloc_slot(self) -> int:
        free = np.flatnonzero(~self._used)
        if free.size == 0:
            raise PoolFullError(f"all {self.max_slots} slots are in use")
        s = int(free[0])
        self._used[s] = True
        self.lengths[s] = 0
        return s

    def free_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self.truncate(slot, 0)
        self._used[slot] = False

    def free_slots(self) -> int:
        return int((~self._used).sum())

    def length(self, slot: int) -> int:
        return int(self.lengths[slot])

    def truncate(self, slot: int, n: int) -> None:
        """Keep the first n tokens of a slot; blocks past them go back to the free list."""
        self._check_slot(slot)
        if n < 0:
            raise ValueError(f"slot {slot}: truncate to {n=} tokens, must be >= 0")
        keep = math.ceil(n / self.block_size)
        row = self.block_tables[slot]
        for b in row[keep:][row[keep:] >= 0][::-1]:
            self._free_blocks.append(int(b))
        row[keep:] = -1
        self.lengths[slot] = min(int(self.lengths[slot]), n)

    def _check_slot(self, slot: int) -> None:
        if not (0 <= slot < self.max_slots and self._used[slot]):
            raise KeyError(f"slot {slot} is not allocated")

    # -- argument checks, shared by every pool: a bad layer, shape or position is an error
    # naming it, never a broadcast row, a negative list index or a read of unwritten rows
    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"{layer=} is outside the pool's {self.n_layers} layers")

    @staticmethod
    def _batch(slots, positions) -> tuple[np.ndarray, np.ndarray]:
        slots, positions = np.asarray(slots, np.int64), np.asarray(positions, np.int64)
        if slots.ndim != 1 or slots.shape != positions.shape:
            raise ValueError(f"slots {slots.shape} and positions {positions.shape} must be "
                             f"equal 1-d shapes")
        return slots, positions

    @staticmethod
    def _check_shapes(n: int, **arrays) -> None:
        """Each keyword is name=(array, row shape); the leading axis must be N."""
        for name, (a, tail) in arrays.items():
            shape = tuple(a.shape) if hasattr(a, "shape") else np.shape(a)  # (lists too)
            if shape != (n, *tail):
                raise ValueError(f"{name} has shape {shape}, expected {(n, *tail)}")

    def _write_args(self, layer: int, slots, positions, coded: bool, rows: tuple):
        """A write's (slots, positions, rows), all checked before anything is uploaded,
        encoded or allocated: the layer; the rows' shapes ((L, R) float rows, or (l_codes,
        l_scale, r_codes, r_scale) when coded, whose host codes are cast by the reference's
        rule, codecs.as_codes); and the positions (_check_positions)."""
        self._check_layer(layer)
        slots, positions = self._batch(slots, positions)
        if coded:
            wl, wr = self.tier.code_width(self.kv_lora), self.tier.code_width(self.rope)
            names, tails = ("l_codes", "l_scale", "r_codes", "r_scale"), ((wl,), (), (wr,), ())
            rows = tuple(codecs.as_codes(self.tier, a) if i in (0, 2) and isinstance(
                a, (np.ndarray, list)) else a for i, a in enumerate(rows))
        else:
            names, tails = ("L", "R"), ((self.kv_lora,), (self.rope,))
        self._check_shapes(len(slots), **{n: (a, t) for n, a, t in zip(names, rows, tails)})
        self._check_positions(slots, positions)
        return slots, positions, rows

    def _check_slots(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(unique slots, each token's index in them), checking that they are allocated."""
        uniq, inv = np.unique(slots, return_inverse=True)
        ok = (uniq >= 0) & (uniq < self.max_slots)
        ok[ok] = self._used[uniq[ok]]
        if not ok.all():
            raise KeyError(f"slot {int(uniq[~ok][0])} is not allocated")
        return uniq, inv

    def _per_slot(self, slots: np.ndarray, positions: np.ndarray):
        """(unique slots, each token's index in them, each slot's highest position, the
        blocks each slot's table needs for it), checking that the slots are allocated."""
        uniq, inv = self._check_slots(slots)
        top = np.full(len(uniq), -1, np.int64)
        np.maximum.at(top, inv, positions)
        return uniq, inv, top, -(-(top + 1) // self.block_size)

    def _check_positions(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """A write's positions: >= 0, in allocated slots, within each slot's capacity, with
        enough free blocks for all of them together, and without a gap: a write may
        overwrite rows and append after them, but every position up to the slot's new
        length is written (lengths are per slot, so this holds for the layers written)."""
        if not slots.size:
            return
        if positions.min() < 0:
            i = int(np.argmin(positions))
            raise ValueError(f"slot {int(slots[i])}: write at position {int(positions[i])}, "
                             f"positions must be >= 0")
        uniq, inv, top, need = self._per_slot(slots, positions)
        over = need > self.block_tables.shape[1]
        if over.any():
            i = int(np.argmax(over))
            raise PoolFullError(f"slot {int(uniq[i])}: {int(top[i]) + 1} tokens exceed the slot "
                                f"capacity of {self.capacity_tokens}")
        n = self.lengths[uniq]
        new = positions >= n[inv]  # appended tokens: distinct ones per slot must be contiguous
        key = np.unique(inv[new] * (int(positions.max()) + 1) + positions[new])
        count = np.bincount(key // (int(positions.max()) + 1), minlength=len(uniq))
        gap = count != np.maximum(top - n + 1, 0)
        if gap.any():
            i = int(np.argmax(gap))
            got = positions[(inv == i) & new]
            hole = int(np.setdiff1d(np.arange(n[i], top[i] + 1), got)[0])
            raise ValueError(f"slot {int(uniq[i])}: a write up to position {int(top[i])} leaves "
                             f"position {hole} unwritten (the slot holds {int(n[i])} tokens; rows "
                             f"are written without gaps)")
        cols = np.arange(self.block_tables.shape[1])
        missing = int(((self.block_tables[uniq] < 0) & (cols[None, :] < need[:, None])).sum())
        if missing > len(self._free_blocks):
            raise PoolFullError(f"the write needs {missing} new blocks, "
                                f"{len(self._free_blocks)} free")

    def _span(self, slot: int, start: int, end: int | None) -> np.ndarray:
        """Positions [start, end) of a slot's written tokens (end None: its length); past
        the length the block table holds -1, which would index another slot's block."""
        self._check_slot(slot)
        n = self.length(slot)
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise ValueError(f"slot {slot}: rows [{start}, {end}) are outside its {n} "
                             f"written tokens")
        return np.arange(start, end)

    def _allocate(self, slots: np.ndarray, need: np.ndarray) -> int:
        """Give each slot's table its first need[i] blocks where it has none yet, in one
        pass (slot order, then block order: the ids a block-by-block pop() would give);
        returns how many were taken. _check_positions has made sure that they fit."""
        cols = np.arange(self.block_tables.shape[1])
        rows = self.block_tables[slots]
        hole = (rows < 0) & (cols[None, :] < need[:, None])
        k = int(hole.sum())
        if k > len(self._free_blocks):  # (unreachable after _check_positions)
            raise PoolFullError(f"the write needs {k} new blocks, {len(self._free_blocks)} free")
        if k:
            rows[hole] = self._free_blocks[-k:][::-1]  # (pop() order)
            del self._free_blocks[-k:]
            self.block_tables[slots] = rows
        return k

    def _where(self, slots: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block id, offset) of each (slot, position) of a write that _write_args checked,
        taking the blocks it needs."""
        if not slots.size:
            return slots, positions
        uniq, _, top, need = self._per_slot(slots, positions)
        self._allocate(uniq, need)
        blk = self.block_tables[slots, positions // self.block_size]
        return blk, positions % self.block_size

    # -- rows -------------------------------------------------------------------------
    def write(self, layer: int, slots, positions, L: np.ndarray, R: np.ndarray) -> None:
        """Encode and store rows L [N, kv_lora] and R [N, rope] at (slot, position)."""
        slots, positions, _ = self._write_args(layer, slots, positions, False, (L, R))
        l_codes, l_scale = codecs.encode_rows(self.tier, np.asarray(L, np.float32))
        r_codes, r_scale = codecs.encode_rows(self.tier, np.asarray(R, np.float32))
        self._put(layer, slots, positions, l_codes, l_scale, r_codes, r_scale)

    def write_coded(self, layer: int, slots, positions, l_codes, l_scale, r_codes,
                    r_scale) -> None:
        """Store rows that are already in the tier's code layout (e.g. read from disk)."""
        slots, positions, rows = self._write_args(layer, slots, positions, True,
                                                  (l_codes, l_scale, r_codes, r_scale))
        self._put(layer, slots, positions, *rows)

    def _put(self, layer: int, slots, positions, l_codes, l_scale, r_codes, r_scale) -> None:
        """Store coded rows at checked (slot, position)s (_write_args) and extend the slots'
        lengths; each pool stores into its own planes."""
        blk, off = self._where(slots, positions)
        p = self.planes[layer]
        p.l_codes[blk, off] = l_codes
        p.l_scale[blk, off] = l_scale
        p.r_codes[blk, off] = r_codes
        p.r_scale[blk, off] = r_scale
        np.maximum.at(self.lengths, slots, positions + 1)

    def read_rows(self, slot: int, layer: int, start: int = 0, end: int | None = None):
        """Coded rows [start, end) of a slot: (l_codes, l_scale, r_codes, r_scale)."""
        self._check_layer(layer)
        pos = self._span(slot, start, end)
        blk = self.block_tables[slot, pos // self.block_size]
        off = pos % self.block_size
        p = self.planes[layer]
        return (p.l_codes[blk, off], p.l_scale[blk, off], p.r_codes[blk, off],
                p.r_scale[blk, off])

    def _attend_args(self, layer: int, slots, positions, q_lat, q_rope):
        """An attend call's (slots, positions) as int64 arrays, checked for every pool: the
        layer, equal 1-d shapes, allocated slots, positions inside each slot's written rows
        (past them the rows are unwritten, NaN in the device pools), and queries q_lat
        [N, H, kv_lora], q_rope [N, H, rope] (one query is never broadcast over N)."""
        self._check_layer(layer)
        slots, positions = self._batch(slots, positions)
        if slots.size:
            uniq, inv = self._check_slots(slots)
            n = self.lengths[uniq][inv]
            bad = (positions < 0) | (positions >= n)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"slot {slots[i]}: attend at position {positions[i]}, outside "
                                 f"its {n[i]} written tokens")
        H = q_lat.shape[1] if len(q_lat.shape) == 3 else -1
        self._check_shapes(len(slots), q_lat=(q_lat, (H, self.kv_lora)),
                           q_rope=(q_rope, (H, self.rope)))
        return slots, positions

    def attend(self, layer: int, slots, positions, q_lat: np.ndarray, q_rope: np.ndarray,
               scale: float) -> np.ndarray:
        """Attention for a flat batch of N query tokens, each at (slot, position), over the
        slot's rows 0..position. q_lat [N, H, kv_lora], q_rope [N, H, rope] -> ctx
        [N, H, kv_lora]. Tokens are grouped per slot so that one kernel call covers a ragged
        decode step (many slots, one token each) and a prefill chunk alike."""
        slots, positions = self._attend_args(layer, slots, positions, q_lat, q_rope)
        return attend_by_slot(self.tier, lambda uniq: (self.planes[layer], self.block_tables[uniq]),
                              slots, positions, q_lat, q_rope, scale, self.rebuilds)

    # -- accounting -------------------------------------------------------------------
    def bytes_per_token(self) -> int:
        """Tier bytes of one token over all layers (rows and scales, as the tier table says)."""
        return self.n_layers * self.tier.token_bytes(self.kv_lora, self.rope)

    def bytes_in_use(self) -> int:
        """Tier bytes of the blocks that slots hold now."""
        return int((self.block_tables >= 0).sum()) * self.block_size * self.bytes_per_token()

    def bytes_capacity(self) -> int:
        return self.n_blocks * self.block_size * self.bytes_per_token()
