"""The paged pool and the paged attention kernel against a plain float64 reference."""
import numpy as np
import pytest

from kernels.cpu import codecs
from kernels.tiers import TIERS
from kvstore.pool import KVPool, PoolFullError

DL, DR, H = 512, 64, 4


def _reference(L, R, q_lat, q_rope, pos, scale):
    """Plain attention of one query over rows 0..pos in float64."""
    s = (L[: pos + 1] @ q_lat.T.astype(np.float64) + R[: pos + 1] @ q_rope.T.astype(np.float64)) * scale
    p = np.exp(s - s.max(0))
    p /= p.sum(0)
    return (p.T @ L[: pos + 1]).astype(np.float64)  # [H, DL]


def _pool(tier="f32", slots=4, blocks=40, bs=16, seed=0):
    pool = KVPool(2, DL, DR, tier, n_blocks=blocks, block_size=bs, max_slots=slots,
                  max_blocks_per_slot=10)
    rng = np.random.default_rng(seed)
    rng.shuffle(pool._free_blocks)  # blocks land in a scattered order, like a long-lived pool
    return pool


def test_ragged_decode_matches_reference_with_nan_garbage():
    rng = np.random.default_rng(1)
    pool = _pool()
    lens = [37, 5, 100, 64]
    rows = {}
    for n in lens:
        s = pool.alloc_slot()
        L = rng.standard_normal((n, DL)).astype(np.float32)
        R = rng.standard_normal((n, DR)).astype(np.float32)
        rows[s] = (L, R)
        for layer in range(2):
            pool.write(layer, np.full(n, s), np.arange(n), L, R)
    assert [pool.length(s) for s in rows] == lens
    # unwritten positions inside the last blocks hold NaN: they must never leak in
    assert np.isnan(pool.planes[0].l_codes).any()
    slots = np.array(list(rows))[::-1].copy()  # not in slot order
    positions = np.array([lens[s] - 1 for s in slots])
    q_lat = rng.standard_normal((len(slots), H, DL)).astype(np.float32)
    q_rope = rng.standard_normal((len(slots), H, DR)).astype(np.float32)
    ctx = pool.attend(1, slots, positions, q_lat, q_rope, 0.05)
    assert np.isfinite(ctx).all()
    for i, s in enumerate(slots):
        ref = _reference(*rows[s], q_lat[i], q_rope[i], positions[i], 0.05)
        np.testing.assert_allclose(ctx[i], ref, rtol=1e-5, atol=1e-5)


def test_prefill_chunk_is_causal_and_mixed_batches_work():
    rng = np.random.default_rng(2)
    pool = _pool()
    a, b = pool.alloc_slot(), pool.alloc_slot()
    La, Ra = rng.standard_normal((30, DL)).astype(np.float32), rng.standard_normal((30, DR)).astype(np.float32)
    Lb, Rb = rng.standard_normal((9, DL)).astype(np.float32), rng.standard_normal((9, DR)).astype(np.float32)
    pool.write(0, np.full(30, a), np.arange(30), La, Ra)
    pool.write(0, np.full(9, b), np.arange(9), Lb, Rb)
    # one call: slot a's positions 20..29 (a prefill chunk) and slot b's last token
    slots = np.array([a] * 10 + [b])
    pos = np.array(list(range(20, 30)) + [8])
    perm = rng.permutation(len(slots))
    slots, pos = slots[perm], pos[perm]
    ql = rng.standard_normal((len(slots), H, DL)).astype(np.float32)
    qr = rng.standard_normal((len(slots), H, DR)).astype(np.float32)
    ctx = pool.attend(0, slots, pos, ql, qr, 0.07)
    for i in range(len(slots)):
        L, R = (La, Ra) if slots[i] == a else (Lb, Rb)
        np.testing.assert_allclose(ctx[i], _reference(L, R, ql[i], qr[i], pos[i], 0.07),
                                   rtol=1e-5, atol=1e-5)


def test_slots_blocks_and_accounting():
    pool = _pool(tier="f32", slots=2, blocks=12, bs=16)
    s = pool.alloc_slot()
    t = pool.alloc_slot()
    with pytest.raises(PoolFullError):
        pool.alloc_slot()
    x = np.ones((50, DL), np.float32)
    y = np.ones((50, DR), np.float32)
    pool.write(0, np.full(50, s), np.arange(50), x, y)  # 4 blocks
    assert pool.bytes_in_use() == 4 * 16 * 2 * TIERS["f32"].token_bytes(DL, DR)
    pool.truncate(s, 17)  # keeps 2 blocks
    assert pool.length(s) == 17 and (pool.block_tables[s] >= 0).sum() == 2
    with pytest.raises(PoolFullError):  # the per-slot table holds 10 blocks = 160 tokens
        pool.write(0, [t], [160], x[:1], y[:1])
    pool.free_slot(s)
    assert pool.free_slots() == 1 and (pool.block_tables[s] < 0).all()
    with pytest.raises(KeyError):
        pool.write(0, [s], [0], x[:1], y[:1])
    assert len(pool._free_blocks) == 12


def test_for_model_sizes_from_tier_table():
    class Cfg:
        num_hidden_layers, kv_lora_rank, qk_rope_head_dim = 3, 512, 64
    for name, tier in TIERS.items():
        pool = KVPool.for_model(Cfg, name, slots=2, max_ctx=100)
        assert pool.capacity_tokens == 112
        assert pool.bytes_capacity() == 2 * 112 * 3 * tier.token_bytes(512, 64)


def test_out_of_range_rows_never_touch_another_slot():
    from kvstore.prefix import from_pool
    pool = _pool(tier="kv8", slots=3, blocks=12, bs=4)
    rng = np.random.default_rng(7)
    a, b = pool.alloc_slot(), pool.alloc_slot()
    for s in (a, b):  # hostile rows: NaN, Inf and huge values, interleaved blocks
        pool.write(0, np.full(12, s), rng.permutation(12), rng.standard_normal((12, DL)) * 1e30,
                   np.where(rng.random((12, DR)) < 0.1, np.nan, 1.0))
    pool.truncate(a, 3)  # a keeps one block, length 3; the rest of its table is -1
    b_rows = [x.copy() for x in pool.read_rows(b, 0)]
    for start, end in [(0, 4), (0, 12), (2, 5), (-1, 2), (3, 2), (13, 14)]:
        with pytest.raises(ValueError, match=rf"slot {a}: rows \[{start}, {end}\) are outside its 3"):
            pool.read_rows(a, 0, start, end)
    with pytest.raises(ValueError, match=rf"slot {a}: rows \[0, 8\)"):
        from_pool(pool, a, np.arange(8, dtype=np.int32), end=8)
    for pos in ([-1], [0, 1, -5]):
        with pytest.raises(ValueError, match=rf"slot {a}: write at position {min(pos)}"):
            n = len(pos)
            pool.write(0, [a] * n, pos, np.full((n, DL), -99.0), np.full((n, DR), -99.0))
    with pytest.raises(ValueError, match=rf"slot {b}: truncate to n=-3"):
        pool.truncate(b, -3)
    assert pool.length(a) == 3 and pool.length(b) == 12 and (pool.block_tables[b] >= 0).sum() == 3
    for x, y in zip(b_rows, pool.read_rows(b, 0)):
        assert x.tobytes() == y.tobytes()  # slot b is untouched
    assert len(pool.read_rows(a, 0, 3, 3)[0]) == 0 and len(pool.read_rows(a, 0)[0]) == 3


@pytest.mark.parametrize("tier", ["tq4", "polar3"])
def test_rotated_tiers_refuse_widths_the_rotation_cannot_take(tier):
    """(such rows were stored as inert zeros: the pool attended to nothing, counted nowhere)"""
    with pytest.raises(ValueError, match=rf"tier {tier} .*kv_lora_rank 384 and qk_rope_head_dim 64"):
        KVPool(2, 384, 64, tier, n_blocks=4)
    with pytest.raises(ValueError, match="qk_rope_head_dim 48"):
        KVPool(2, 512, 48, tier, n_blocks=4)
    for ok in ("f32", "kv8"):
        KVPool(2, 384, 48, ok, n_blocks=4)
    KVPool(2, 512, 64, tier, n_blocks=4)


def test_attend_refuses_positions_past_the_written_rows():
    """(a position past the slot's length read the NaN of unwritten rows into the context;
    an unallocated slot attended to whatever its table row held)"""
    pool = _pool(tier="kv8", bs=8)
    rng = np.random.default_rng(11)
    s = pool.alloc_slot()
    pool.write(0, np.full(5, s), np.arange(5), rng.standard_normal((5, DL)),
               rng.standard_normal((5, DR)))
    ql = rng.standard_normal((1, H, DL)).astype(np.float32)
    qr = rng.standard_normal((1, H, DR)).astype(np.float32)
    assert np.isfinite(pool.attend(0, [s], [4], ql, qr, 0.1)).all()
    for pos in (5, 7, 20, -1):
        with pytest.raises(ValueError, match=rf"slot {s}: attend at position {pos}, outside its 5"):
            pool.attend(0, [s], [pos], ql, qr, 0.1)
    with pytest.raises(KeyError, match="slot 3 is not allocated"):
        pool.attend(0, [3], [0], ql, qr, 0.1)


def test_writes_name_bad_layers_shapes_and_gaps_and_keep_the_pool():
    """layer -1 wrote the last layer (a negative list index), one row was broadcast over N
    positions, and a write that skipped positions left unwritten rows (NaN) inside the slot's
    length, which attend then read. Each is now an error, raised before anything changes."""
    pool = _pool(tier="kv8", slots=2, blocks=8, bs=4)
    s = pool.alloc_slot()
    rng = np.random.default_rng(8)
    L, R = rng.standard_normal((3, DL)).astype(np.float32), rng.standard_normal((3, DR)).astype(np.float32)
    pool.write(0, [s] * 3, [0, 1, 2], L, R)
    before = (pool.length(s), pool.block_tables.copy(), list(pool._free_blocks))
    with pytest.raises(IndexError, match="layer=-1 is outside"):
        pool.write(-1, [s], [3], L[:1], R[:1])
    with pytest.raises(ValueError, match=r"L has shape \(1, 512\), expected \(2, 512\)"):
        pool.write(0, [s, s], [3, 4], L[:1], R[:2])
    with pytest.raises(ValueError, match="leaves position 3 unwritten"):
        pool.write(0, [s, s], [4, 9], L[:2], R[:2])
    with pytest.raises(IndexError, match="layer=5"):
        pool.read_rows(s, 5)
    assert (pool.length(s), list(pool._free_blocks)) == (before[0], before[2])
    assert np.array_equal(pool.block_tables, before[1])
    pool.write(0, [s, s, s], [4, 3, 1], L, R)  # append out of order and overwrite: no gap
    assert pool.length(s) == 5
    q = rng.standard_normal((1, 2, DL)).astype(np.float32)
    qr = rng.standard_normal((1, 2, DR)).astype(np.float32)
    assert np.isfinite(pool.attend(0, [s], [4], q, qr, 0.1)).all()


def test_rejected_writes_take_no_blocks_and_attend_checks_query_shapes():
    """A write that two slots cannot both fit took the first slot's blocks before failing
    on the second; host codes outside a byte were wrapped into the planes; one query row was
    broadcast over N attend positions."""
    from kernels.tiers import TierError
    pool = _pool(tier="kv8", slots=2, blocks=3, bs=4)
    a, b = pool.alloc_slot(), pool.alloc_slot()
    rng = np.random.default_rng(9)
    L = rng.standard_normal((12, DL)).astype(np.float32)
    R = rng.standard_normal((12, DR)).astype(np.float32)
    slots, pos = np.repeat([a, b], 6), np.tile(np.arange(6), 2)  # 2 blocks each, 3 free
    with pytest.raises(PoolFullError, match="needs 4 new blocks, 3 free"):
        pool.write(0, slots, pos, L, R)
    assert (pool.block_tables < 0).all() and len(pool._free_blocks) == 3
    pool.write(0, [a] * 3, [0, 1, 2], L[:3], R[:3])
    lc, ls = codecs.encode_rows("kv8", L[:1])
    rc, rs = codecs.encode_rows("kv8", R[:1])
    wide = lc.astype(np.int64)
    wide[0, 0] = 300
    with pytest.raises(TierError, match="in .*300"):
        pool.write_coded(0, [a], [3], wide, ls, rc, rs)
    with pytest.raises(TierError, match="must be uint8"):
        pool.write_coded(0, [a], [3], lc.astype(np.float32) + 0.5, ls, rc, rs)
    assert pool.length(a) == 3
    q = rng.standard_normal((1, H, DL)).astype(np.float32)
    qr = rng.standard_normal((2, H, DR)).astype(np.float32)
    with pytest.raises(ValueError, match=r"q_lat has shape \(1, 4, 512\), expected \(2, 4, 512\)"):
        pool.attend(0, [a, a], [1, 2], q, qr, 0.1)


def test_block_allocation_matches_one_pop_per_block():
    """_allocate gives all the blocks of a write in one pass; the ids are those a pop() per
    missing block (slot order, then block order) gives: ragged decode steps, a long
    prefill chunk, slots freed and reused, in random order."""
    rng = np.random.default_rng(12)
    pool = KVPool(1, 16, 8, "f32", n_blocks=96, block_size=4, max_slots=8, max_blocks_per_slot=12)
    free = list(range(95, -1, -1))  # the reference: the pool's own list, pop() per block
    tables = {}
    lengths = {}
    for step in range(60):
        if step % 9 == 8 and lengths:  # free a slot now and then
            s = int(rng.choice(sorted(lengths)))
            pool.free_slot(s)
            free.extend([b for b in tables.pop(s) if b >= 0][::-1])  # (truncate's order)
            del lengths[s]
        while len(lengths) < 5:
            s = pool.alloc_slot()
            lengths[s], tables[s] = 0, [-1] * 12
        slots, pos = [], []
        for s in sorted(lengths):
            n = int(rng.integers(1, 9)) if rng.random() < 0.3 else 1
            n = min(n, 48 - lengths[s])
            slots += [s] * n
            pos += list(range(lengths[s], lengths[s] + n))
        order = rng.permutation(len(slots))
        slots, pos = np.array(slots)[order], np.array(pos)[order]
        for s in sorted(set(slots.tolist())):
            top = int(pos[slots == s].max())
            for b in range(top // 4 + 1):
                if tables[s][b] < 0:
                    tables[s][b] = free.pop()
            lengths[s] = top + 1
        pool.write(0, slots, pos, rng.standard_normal((len(slots), 16)).astype(np.float32),
                   rng.standard_normal((len(slots), 8)).astype(np.float32))
        for s in lengths:
            assert pool.block_tables[s].tolist() == tables[s], (step, s)
