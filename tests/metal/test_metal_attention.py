"""MLX paged attention vs the numpy reference (kernels/cpu/attention.py) and a float64
decode-then-attend reference, for f32/kv8/tq4, over hostile pools: NaN / 0xFF garbage in
unused positions, shuffled block tables, ragged slots, padding queries."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from kernels.cpu import attention as cpu_attn  # noqa: E402
from kernels.cpu import codecs as cpu_codecs  # noqa: E402
from kernels.metal.attention import paged_mla_attention  # noqa: E402
from kernels.metal.backend import KernelStats  # noqa: E402
from kernels.tiers import get_tier  # noqa: E402

TIERS = ["f32", "kv8", "tq4"]


def make_pool(rng, tier, lengths, Dl, Dr, bs, extra_blocks=5):
    """Planes filled with garbage, rows 0..len-1 of each slot written through a shuffled
    block table; returns (numpy planes, block_tables, the f32 rows L/R per slot)."""
    tier = get_tier(tier)
    nb = max(-(-n // bs) for n in lengths) + 1
    n_blocks = sum(-(-n // bs) for n in lengths) + extra_blocks
    garbage = np.nan if tier.code_dtype() == "float32" else 0xFF
    dt = np.dtype(tier.code_dtype())
    planes = cpu_attn.LayerPlanes(
        np.full((n_blocks, bs, tier.code_width(Dl)), garbage, dt), np.full((n_blocks, bs), np.nan, np.float32),
        np.full((n_blocks, bs, tier.code_width(Dr)), garbage, dt), np.full((n_blocks, bs), np.nan, np.float32))
    ids = rng.permutation(n_blocks)
    tables = np.full((len(lengths), nb), -1, np.int32)
    rows, k = [], 0
    for b, n in enumerate(lengths):
        need = -(-n // bs)
        tables[b, :need] = ids[k:k + need]
        k += need
        L = (rng.standard_normal((n, Dl)) * rng.uniform(0.2, 3, (n, 1))).astype(np.float32)
        R = rng.standard_normal((n, Dr)).astype(np.float32)
        t = np.arange(n)
        blk, off = tables[b, t // bs], t % bs
        planes.l_codes[blk, off], planes.l_scale[blk, off] = cpu_codecs.encode_rows(tier, L)
        planes.r_codes[blk, off], planes.r_scale[blk, off] = cpu_codecs.encode_rows(tier, R)
        if tier.kind == "f32":  # the pool keeps a scale plane of ones for f32
            planes.l_scale[blk, off] = planes.r_scale[blk, off] = 1.0
        rows.append((L, R))
    return planes, tables, rows


def to_mx(planes):
    return cpu_attn.LayerPlanes(*(mx.array(a) for a in (planes.l_codes, planes.l_scale,
                                                       planes.r_codes, planes.r_scale)))


def reference64(tier, planes, tables, q_lat, q_rope, q_pos, scale):
    """Decode each slot's visible rows with the numpy codec, attend in float64."""
    B, Q, H, Dl = q_lat.shape
    Dr = q_rope.shape[-1]
    bs = planes.l_codes.shape[1]
    out = np.zeros((B, Q, H, Dl))
    for b in range(B):
        for q in range(Q):
            n = q_pos[b, q] + 1
            if n <= 0:
                continue
            t = np.arange(n)
            blk, off = tables[b, t // bs], t % bs
            L = cpu_codecs.decode_rows(tier, planes.l_codes[blk, off], planes.l_scale[blk, off], Dl)
            R = cpu_codecs.decode_rows(tier, planes.r_codes[blk, off], planes.r_scale[blk, off], Dr)
            s = (q_lat[b, q].astype(np.float64) @ L.T.astype(np.float64)
                 + q_rope[b, q].astype(np.float64) @ R.T.astype(np.float64)) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, q] = (p / p.sum(-1, keepdims=True)) @ L.astype(np.float64)
    return out


def check_close(got, ref, rtol=1e-5):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and not np.isnan(ref).any()
    scale = np.abs(ref).max(axis=-1, keepdims=True) + 1e-30
    rel = np.abs(got - ref) / scale
    assert rel.max() <= rtol, f"max relative error {rel.max():.3g} > {rtol}"
    zero = np.abs(ref).max(axis=-1) == 0
    assert np.all(np.abs(got).max(axis=-1)[zero] == 0)


def queries(rng, lengths, Q, H, Dl, Dr, pad=True):
    B = len(lengths)
    q_lat = rng.standard_normal((B, Q, H, Dl)).astype(np.float32)
    q_rope = rng.standard_normal((B, Q, H, Dr)).astype(np.float32)
    q_pos = np.array([[n - Q + j for j in range(Q)] for n in lengths], np.int64)
    if pad and Q > 1:
        q_pos[0, 0] = -1  # a padding query
    return q_lat, q_rope, q_pos


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("bs", [16, 4])
def test_ragged_decode_matches_numpy(tier, bs):
    rng = np.random.default_rng(1 + bs)
    lengths = [37, 1, 130, 64, 5]
    Dl, Dr, H = 128, 32, 4
    planes, tables, _ = make_pool(rng, tier, lengths, Dl, Dr, bs)
    q_lat, q_rope, q_pos = queries(rng, lengths, 1, H, Dl, Dr)
    scale = 0.11
    stats = KernelStats()
    got = paged_mla_attention(tier, to_mx(planes), tables, mx.array(q_lat), mx.array(q_rope),
                              q_pos, scale, stats=stats, chunk_tokens=32)
    check_close(got, reference64(tier, planes, tables, q_lat, q_rope, q_pos, scale))
    cpu = cpu_attn.paged_mla_attention(get_tier(tier), planes, tables, q_lat, q_rope, q_pos, scale)
    check_close(got, cpu.astype(np.float64))
    assert stats.fallback["paged_attention"] == 1


@pytest.mark.parametrize("tier", TIERS)
def test_prefill_chunk_causal_with_padding(tier):
    rng = np.random.default_rng(5)
    lengths = [50, 23]
    Dl, Dr, H, Q = 64, 16, 3, 7
    planes, tables, _ = make_pool(rng, tier, lengths, Dl, Dr, 8)
    q_lat, q_rope, q_pos = queries(rng, lengths, Q, H, Dl, Dr)
    got = paged_mla_attention(tier, to_mx(planes), tables, mx.array(q_lat), mx.array(q_rope),
                              q_pos, 0.3, chunk_tokens=16)
    ref = reference64(tier, planes, tables, q_lat, q_rope, q_pos, 0.3)
    check_close(got, ref)
    assert np.all(np.array(got)[0, 0] == 0)  # the padding query


def test_chunk_size_does_not_change_the_result_beyond_rounding():
    rng = np.random.default_rng(8)
    lengths = [300, 77]
    planes, tables, _ = make_pool(rng, "tq4", lengths, 128, 32, 16)
    q_lat, q_rope, q_pos = queries(rng, lengths, 1, 2, 128, 32)
    a = paged_mla_attention("tq4", to_mx(planes), tables, mx.array(q_lat), mx.array(q_rope), q_pos, 0.1, chunk_tokens=16)
    b = paged_mla_attention("tq4", to_mx(planes), tables, mx.array(q_lat), mx.array(q_rope), q_pos, 0.1, chunk_tokens=4096)
    check_close(a, np.array(b).astype(np.float64))


def test_large_logits_do_not_overflow():
    rng = np.random.default_rng(9)
    lengths = [40]
    planes, tables, _ = make_pool(rng, "kv8", lengths, 64, 16, 16)
    q_lat, q_rope, q_pos = queries(rng, lengths, 1, 2, 64, 16)
    q_lat *= 200  # scores in the thousands: a naive exp overflows
    got = paged_mla_attention("kv8", to_mx(planes), tables, mx.array(q_lat), mx.array(q_rope), q_pos, 1.0, chunk_tokens=16)
    check_close(got, reference64("kv8", planes, tables, q_lat, q_rope, q_pos, 1.0))


def test_all_padding_gives_zeros_and_bad_shapes_are_named():
    rng = np.random.default_rng(3)
    planes, tables, _ = make_pool(rng, "f32", [4], 16, 8, 4)
    q = mx.array(rng.standard_normal((1, 1, 2, 16)).astype(np.float32))
    qr = mx.array(rng.standard_normal((1, 1, 2, 8)).astype(np.float32))
    out = paged_mla_attention("f32", to_mx(planes), tables, q, qr, np.full((1, 1), -1), 1.0)
    assert np.all(np.array(out) == 0)
    with pytest.raises(ValueError, match="q_pos"):
        paged_mla_attention("f32", to_mx(planes), tables, q, qr, np.zeros((2, 1)), 1.0)
    p3, t3, _ = make_pool(rng, "polar3", [4], 16, 8, 4)
    with pytest.raises(ValueError, match="rebuilds"):  # (the numpy path's row counter)
        paged_mla_attention("polar3", to_mx(p3), t3, q, qr, np.zeros((1, 1)), 1.0)


def same_coded_rows(pools, slots, layer=1):
    """Both pools hold byte-identical coded rows (codes and scales) for every slot."""
    for s in slots:
        for x, y in zip(pools[0].read_rows(s, layer), pools[1].read_rows(s, layer)):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def attend_both(pools, rng, q_slots, q_posn, H, Dl, Dr, scale, layer=1):
    """(numpy pool's context, MLX pool's) for one random query batch at (slot, position)."""
    ql = rng.standard_normal((len(q_slots), H, Dl)).astype(np.float32)
    qr = rng.standard_normal((len(q_slots), H, Dr)).astype(np.float32)
    return (pools[0].attend(layer, q_slots, q_posn, ql, qr, scale),
            pools[1].attend(layer, q_slots, q_posn, mx.array(ql), mx.array(qr), scale))


@pytest.mark.parametrize("tier", TIERS)
def test_mlx_pool_matches_numpy_pool(tier):
    """Same writes into kvstore.pool.KVPool and the MLX pool: identical coded rows, attention
    within 1e-5, for a ragged decode step and a prefill chunk; truncate/free are inherited."""
    from kernels.metal.pool import MLXKVPool
    from kvstore.pool import KVPool
    rng = np.random.default_rng(21)
    Dl, Dr, H = 64, 16, 2
    pools = [cls(2, Dl, Dr, tier, n_blocks=40, block_size=8, max_slots=4) for cls in (KVPool, MLXKVPool)]
    slots = [p.alloc_slot() for p in pools for _ in range(3)][:3]
    lengths = {slots[0]: 45, slots[1]: 3, slots[2]: 17}
    for s, n in lengths.items():
        L = rng.standard_normal((n, Dl)).astype(np.float32)
        R = rng.standard_normal((n, Dr)).astype(np.float32)
        for p in pools:
            p.write(1, [s] * n, np.arange(n), L, R)
    same_coded_rows(pools, lengths)
    # ragged decode (one query per slot) and a prefill chunk of the first slot in one batch
    q_slots = np.array([slots[1], slots[0], slots[2], slots[0], slots[0]])
    ref, got = attend_both(pools, rng, q_slots, np.array([2, 44, 16, 40, 41]), H, Dl, Dr, 0.2)
    check_close(np.array(got), ref.astype(np.float64))
    assert pools[1].stats.fallback["paged_attention"] == 1
    assert pools[0].bytes_in_use() == pools[1].bytes_in_use() > 0
    for p in pools:
        p.truncate(slots[0], 20)
        p.free_slot(slots[1])
    assert pools[0].bytes_in_use() == pools[1].bytes_in_use()
    assert pools[1].length(slots[0]) == 20 and pools[1].free_slots() == 2


@pytest.mark.parametrize("tier", ["polar3", "polar5"])
def test_polar_pool_attends_through_the_numpy_reference(tier, caplog):
    """The polar tiers have no MLX codec or attention: MLXKVPool runs the numpy ones on host
    copies of the blocks a call can see. Same codes as KVPool, the same attention bits, the
    same rows rebuilt, every call counted as a fallback. Blocks interleaved between slots
    (shuffled tables), NaN scales and 0xFF codes in every unwritten position, ragged
    lengths, a prefill chunk beside the decode queries."""
    from kernels.metal.pool import MLXKVPool
    from kvstore.pool import KVPool
    rng = np.random.default_rng(5)
    Dl, Dr, H = 64, 16, 2
    pools = [cls(2, Dl, Dr, tier, n_blocks=24, block_size=4, max_slots=4) for cls in (KVPool, MLXKVPool)]
    for p in pools:
        slots = [p.alloc_slot() for _ in range(3)]
    lengths = [(slots[0], 0, 9), (slots[1], 0, 3), (slots[2], 0, 13), (slots[0], 9, 22), (slots[1], 3, 5)]
    for s, a, b in lengths:  # in rounds, so that the slots' blocks interleave
        L = rng.standard_normal((b - a, Dl)).astype(np.float32) * rng.uniform(0.01, 50)
        R = rng.standard_normal((b - a, Dr)).astype(np.float32)
        for p in pools:
            p.write(1, [s] * (b - a), np.arange(a, b), L, R)
    t0 = pools[1].block_tables[slots[0]]
    assert np.any(np.diff(t0[t0 >= 0]) != 1)  # slot 0's blocks are not one run
    same_coded_rows(pools, slots)
    q_slots = np.array([slots[1], slots[0], slots[2], slots[0], slots[0]])
    ref, got = attend_both(pools, rng, q_slots, np.array([4, 21, 12, 15, 16]), H, Dl, Dr, 0.3)
    assert isinstance(got, mx.array) and not np.isnan(ref).any()
    np.testing.assert_array_equal(np.array(got), ref)
    assert pools[1].rebuilds.value == pools[0].rebuilds.value > 0
    fb = pools[1].stats.fallback
    assert fb[f"paged_attention_{tier}"] == 1 and fb[f"encode_{tier}"] == 2 * len(lengths)
    assert "paged_attention" not in fb  # (the MLX-op path never ran)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum(f"paged_attention_{tier} falls back" in m for m in warned) == 1
    assert sum(f"encode_{tier} falls back" in m for m in warned) == 1


def test_native_kernel_guard(monkeypatch):
    """The Metal kernel cannot run here; its guard can: off without Metal, used when the
    self-check agrees, refused (op path, counted) when it disagrees or fails to build."""
    from kernels.metal import native
    tier = get_tier("kv8")
    assert native.usable("kv8", 64, 32, 8) is (native.metal_enabled() and True)
    rng = np.random.default_rng(2)
    planes, tables, _ = make_pool(rng, tier, [20, 9], 64, 32, 8)
    q_lat, q_rope, q_pos = queries(rng, [20, 9], 1, 2, 64, 32)
    args = (to_mx(planes), tables, mx.array(q_lat), mx.array(q_rope), q_pos, 0.2)
    monkeypatch.setattr(native, "metal_enabled", lambda: True)

    def fake_good(t, pl, bt, ql, qr, qp, sc):
        return paged_mla_attention(t, pl, bt, ql, qr, qp, sc, native=False)

    for fake, used in [(fake_good, True), (lambda *a: fake_good(*a) * 1.001, False),
                       (lambda *a: 1 / 0, False)]:
        native.usable.cache_clear()
        monkeypatch.setattr(native, "attend", fake)
        stats = KernelStats()
        out = paged_mla_attention("kv8", *args, stats=stats)
        assert (stats.native["paged_attention"], stats.fallback["paged_attention"]) == (int(used), int(not used))
        check_close(out, reference64("kv8", planes, tables, q_lat, q_rope, q_pos, 0.2))
    native.usable.cache_clear()
    assert not native.supported(get_tier("tq4"), 96, 32) and not native.supported(tier, 80, 32)


def softmax_from(floor):
    """The native kernel's algorithm in numpy (decode the visible rows, softmax from a
    running max that starts at `floor`, None = at the first key), as a stand-in `attend`."""
    def attend(tier, planes, tables, q_lat, q_rope, q_pos, scale):
        lc, ls, rc, rs = (np.array(a) for a in (planes.l_codes, planes.l_scale,
                                                planes.r_codes, planes.r_scale))
        ql, qr = np.array(q_lat), np.array(q_rope)
        B, Q, H, Dl = ql.shape
        bs, out = lc.shape[1], np.zeros(ql.shape, np.float32)
        for b, q in np.ndindex(B, Q):
            t = np.arange(q_pos[b, q] + 1)
            if not len(t):
                continue
            blk, off = tables[b, t // bs], t % bs
            L = cpu_codecs.decode_rows(tier, lc[blk, off], ls[blk, off], Dl)
            R = cpu_codecs.decode_rows(tier, rc[blk, off], rs[blk, off], qr.shape[-1])
            sc = (ql[b, q] @ L.T + qr[b, q] @ R.T) * np.float32(scale)  # [H, T]
            m = sc.max(-1, keepdims=True)
            p = np.exp(sc - (m if floor is None else np.maximum(m, np.float32(floor))))
            den = p.sum(-1, keepdims=True)
            out[b, q] = np.where(den > 0, (p @ L) / np.where(den > 0, den, 1), 0)
        return mx.array(out)
    return attend


@pytest.mark.parametrize("tier", TIERS)
def test_native_self_check_refuses_a_kernel_with_a_softmax_floor(tier, monkeypatch):
    """The Metal kernel started its running max at -1e30, the floor bug the op path had
    (test_scores_below_the_floor): a row whose every score is below it came back as zeros.
    Its self-check had only Gaussian rows and queries, so such a kernel passed and would have
    served every call. The self-check now holds a row of scores near -1e31 (and a prefill
    query beside a padding one): the floor's algorithm is refused, the same algorithm with
    the max taken from the first key (the fixed kernel's) is accepted."""
    from kernels.metal import native
    monkeypatch.setattr(native, "metal_enabled", lambda: True)
    for floor, accepted in [(-1e30, False), (None, True)]:
        native.usable.cache_clear()
        monkeypatch.setattr(native, "attend", softmax_from(floor))
        assert native.usable(tier, 64, 32, 4) is accepted, floor
    native.usable.cache_clear()


@pytest.mark.parametrize("tier", TIERS)
def test_two_thousand_keys_within_1e5_of_numpy(tier):
    rng = np.random.default_rng(31)
    lengths = [2100, 1333]
    Dl, Dr, H = 512, 64, 4
    planes, tables, _ = make_pool(rng, tier, lengths, Dl, Dr, 16)
    q_lat, q_rope, q_pos = queries(rng, lengths, 1, H, Dl, Dr)
    got = paged_mla_attention(tier, to_mx(planes), tables, mx.array(q_lat), mx.array(q_rope),
                              q_pos, 0.07, chunk_tokens=512)
    cpu = cpu_attn.paged_mla_attention(get_tier(tier), planes, tables, q_lat, q_rope, q_pos, 0.07)
    check_close(got, cpu.astype(np.float64))


@pytest.mark.parametrize("n", [2, 16, 64, 512, 2048])
def test_fast_rotation_is_the_same_transform(n):
    from kernels.metal import rotation
    x = mx.array(np.random.default_rng(n).standard_normal((7, n)).astype(np.float32))
    np.testing.assert_allclose(np.array(rotation.rotate_fast(x)), np.array(rotation.rotate(x)),
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.array(rotation.unrotate_fast(rotation.rotate_fast(x))),
                               np.array(x), rtol=0, atol=1e-5)


def test_mlx_pool_reads_only_a_slots_own_rows():
    """MLXKVPool.read_rows has KVPool's bounds: rows past a slot's length are refused (the -1
    of an unused block-table entry indexed another slot's block)."""
    from kernels.metal.pool import MLXKVPool
    pool = MLXKVPool(1, 64, 16, "kv8", n_blocks=6, block_size=4, max_slots=3)
    rng = np.random.default_rng(7)
    a, b = pool.alloc_slot(), pool.alloc_slot()
    for s in (a, b):
        pool.write(0, np.full(12, s), rng.permutation(12), rng.standard_normal((12, 64)).astype(np.float32),
                   rng.standard_normal((12, 16)).astype(np.float32))
    pool.truncate(a, 3)
    assert len(pool.read_rows(a, 0)[0]) == 3
    with pytest.raises(ValueError, match=r"slot 0: rows \[0, 8\) are outside its 3 written tokens"):
        pool.read_rows(a, 0, 0, 8)


@pytest.mark.parametrize("tier", TIERS)
def test_out_of_range_sentinels_in_table_padding_are_never_read(tier):
    """FlashMLA-style tables: entries past a row's keys hold out-of-range sentinels. numpy
    never reads them; the MLX path gathered every column of the chunk (a segfault for a
    sentinel of 2^20 on the CPU backend). A visible entry past the pool is a named error."""
    rng = np.random.default_rng(12)
    lengths = [3, 45, 17]
    planes, tables, _ = make_pool(rng, tier, lengths, 64, 32, 8)
    q_lat, q_rope, q_pos = queries(rng, lengths, 1, 2, 64, 32)
    n_blocks = planes.l_codes.shape[0]
    for sentinel in (n_blocks, 2 ** 20, 2 ** 31 - 1):
        t = np.where(tables < 0, sentinel, tables).astype(np.int32)
        got = paged_mla_attention(tier, to_mx(planes), t, mx.array(q_lat), mx.array(q_rope),
                                  q_pos, 0.1, chunk_tokens=16)
        cpu = cpu_attn.paged_mla_attention(get_tier(tier), planes, t, q_lat, q_rope, q_pos, 0.1)
        check_close(got, cpu.astype(np.float64))
    t = tables.copy()
    t[1, 2] = n_blocks + 3  # row 1 sees 45 keys: entry 2 (keys 16..23) is read
    with pytest.raises(ValueError, match=rf"block_tables\[1, 2\] = {n_blocks + 3} is not a block"):
        paged_mla_attention(tier, to_mx(planes), t, mx.array(q_lat), mx.array(q_rope), q_pos, 0.1)


@pytest.mark.parametrize("tier", TIERS)
def test_scores_below_the_softmax_floor(tier):
    """Every score of a row far below -1e30 (huge queries against keys of one sign): the
    softmax is still the argmax row, as numpy has it; the MLX running max started at a
    finite floor of -1e30, so exp(s - floor) was 0 and the row came back as zeros."""
    rng = np.random.default_rng(13)
    lengths, Dl, Dr, bs = [21, 9], 64, 16, 4
    planes, tables, rows = make_pool(rng, tier, lengths, Dl, Dr, bs)
    for b, n in enumerate(lengths):  # rebuild the L rows with mean ~1, so q = -c scores < 0
        L = (1.0 + 0.3 * rng.standard_normal((n, Dl))).astype(np.float32)
        t = np.arange(n)
        blk, off = tables[b, t // bs], t % bs
        planes.l_codes[blk, off], planes.l_scale[blk, off] = cpu_codecs.encode_rows(tier, L)
        if tier == "f32":
            planes.l_scale[blk, off] = 1.0
    q_lat, q_rope, q_pos = queries(rng, lengths, 2, 3, Dl, Dr)
    q_lat[0] = -1e30  # row 0: scores about -6e31; row 1 keeps ordinary scores
    q_lat[1, :, 0] *= 1e28  # row 1, head 0: scores of both signs up to ~1e29
    got = paged_mla_attention(tier, to_mx(planes), tables, mx.array(q_lat), mx.array(q_rope),
                              q_pos, 1.0, chunk_tokens=8)
    cpu = cpu_attn.paged_mla_attention(get_tier(tier), planes, tables, q_lat, q_rope, q_pos, 1.0)
    assert np.abs(cpu[0, 1]).max() > 0.5  # the case occurs: numpy's context is a real row
    check_close(got, cpu.astype(np.float64))


def test_mlx_pool_names_bad_arguments():
    """Bad layers, shapes, slots and positions are errors that name them. Before: layer -1
    wrote (and attended) the last layer, one L row or one scale was broadcast over every
    position, an unallocated slot attended to nothing (zeros), a query past the written rows
    attended to the pool's NaN garbage, and a wrong width failed inside MLX's scatter."""
    from kernels.metal.pool import MLXKVPool
    pool = MLXKVPool(2, 64, 16, "kv8", n_blocks=8, block_size=4, max_slots=2)
    rng = np.random.default_rng(4)
    s = pool.alloc_slot()
    L, R = rng.standard_normal((5, 64)).astype(np.float32), rng.standard_normal((5, 16)).astype(np.float32)
    pos = np.arange(5)
    with pytest.raises(IndexError, match="layer=-1 is outside the pool's 2 layers"):
        pool.write(-1, [s] * 5, pos, L, R)
    with pytest.raises(ValueError, match=r"L has shape \(1, 64\), expected \(5, 64\)"):
        pool.write(0, [s] * 5, pos, L[:1], R)
    with pytest.raises(ValueError, match=r"R has shape \(5, 8\), expected \(5, 16\)"):
        pool.write(0, [s] * 5, pos, L, R[:, :8])
    lc, ls = cpu_codecs.encode_rows("kv8", L)
    rc, rs = cpu_codecs.encode_rows("kv8", R)
    with pytest.raises(ValueError, match=r"l_scale has shape \(1,\), expected \(5,\)"):
        pool.write_coded(0, [s] * 5, pos, lc, ls[:1], rc, rs)
    assert pool.length(s) == 0  # nothing was stored
    pool.write(0, [s] * 5, pos, L, R)
    q, qr = rng.standard_normal((1, 2, 64)).astype(np.float32), rng.standard_normal((1, 2, 16)).astype(np.float32)
    with pytest.raises(KeyError, match="slot 1 is not allocated"):
        pool.attend(0, [1], [3], q, qr, 0.1)
    with pytest.raises(ValueError, match="slot 0: attend at position 6, outside its 5 written tokens"):
        pool.attend(0, [s], [6], q, qr, 0.1)
    with pytest.raises(ValueError, match=r"q_rope has shape \(1, 1, 16\), expected \(1, 2, 16\)"):
        pool.attend(0, [s], [3], q, qr[:, :1], 0.1)
    with pytest.raises(IndexError, match="layer=2"):
        pool.attend(2, [s], [3], q, qr, 0.1)
    assert np.isfinite(np.array(pool.attend(0, [s], [4], q, qr, 0.1))).all()


@pytest.mark.parametrize("tier", TIERS)
def test_planes_of_another_dtype_or_shape_are_named(tier):
    """The gathers index the planes without bounds checks: int32 tq4 codes past 255 read
    past the level table (a segfault), int32 kv8 codes failed inside mx.from_fp8, an r plane
    with fewer blocks than l would be read out of bounds. Each is now a named error."""
    from dataclasses import replace
    rng = np.random.default_rng(14)
    lengths = [5, 9]
    planes, tables, _ = make_pool(rng, tier, lengths, 64, 32, 8)
    q_lat, q_rope, q_pos = queries(rng, lengths, 1, 2, 64, 32)
    args = (tables, mx.array(q_lat), mx.array(q_rope), q_pos, 0.1)
    good = to_mx(planes)
    wide = mx.float16 if tier == "f32" else mx.int32
    for name, bad in [("l_codes", replace(good, l_codes=good.l_codes.astype(wide) + 256)),
                      ("r_codes", replace(good, r_codes=good.r_codes[:3])),
                      ("l_scale", replace(good, l_scale=good.l_scale[:, :4]))]:
        with pytest.raises(ValueError, match=rf"planes\.{name} is"):
            paged_mla_attention(tier, bad, *args)
    cpu = cpu_attn.paged_mla_attention(get_tier(tier), planes, tables, q_lat, q_rope, q_pos, 0.1)
    check_close(paged_mla_attention(tier, good, *args), cpu.astype(np.float64))


@pytest.mark.parametrize("tier", TIERS)
def test_mlx_pool_takes_numpy_views_with_negative_strides(tier):
    """mx.array refuses numpy views with negative strides (x[::-1]); the numpy pool takes
    any array, the MLX pool and codecs failed on them ("Cannot convert DLPack arrays")."""
    from kernels.metal import codecs
    from kernels.metal.pool import MLXKVPool
    from kvstore.pool import KVPool
    rng = np.random.default_rng(15)
    L = rng.standard_normal((6, 64)).astype(np.float32)[::-1]
    R = rng.standard_normal((6, 16)).astype(np.float32)[:, ::-1]
    pools = [cls(1, 64, 16, tier, n_blocks=6, block_size=4, max_slots=2) for cls in (KVPool, MLXKVPool)]
    lc, ls = cpu_codecs.encode_rows(tier, np.ascontiguousarray(L))
    rc, rs = cpu_codecs.encode_rows(tier, np.ascontiguousarray(R))
    for p in pools:
        a, b = p.alloc_slot(), p.alloc_slot()
        p.write(0, [a] * 6, np.arange(6), L, R)
        p.write_coded(0, [b] * 6, np.arange(6)[::-1], lc[::-1], ls[::-1], rc[::-1], rs[::-1].tolist())
    for s in (0, 1):
        for x, y in zip(pools[0].read_rows(s, 0), pools[1].read_rows(s, 0)):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    q = rng.standard_normal((2, 3, 64)).astype(np.float32)[:, ::-1]
    qr = rng.standard_normal((2, 3, 16)).astype(np.float32)[::-1]
    ref = pools[0].attend(0, [0, 1], [5, 3], q, qr, 0.1)
    check_close(np.array(pools[1].attend(0, [0, 1], [5, 3], q, qr, 0.1)), ref.astype(np.float64))
    c, s = codecs.encode_rows(tier, L)
    np.testing.assert_array_equal(np.array(codecs.decode_rows(tier, np.array(c)[::-1], np.array(s)[::-1], 64)),
                                  cpu_codecs.decode_rows(tier, np.array(c)[::-1], np.array(s)[::-1], 64))


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4", "polar3"])
def test_an_empty_attend_returns_no_rows_like_an_empty_write(tier):
    """A batch of zero queries (a step whose slots all finished, an empty prefill chunk):
    both pools take an empty write; an empty attend raised numpy's "zero-size array to
    reduction operation maximum" (KVPool, MLXKVPool) or MLX's scatter error. Now it is
    ctx [0, H, kv_lora], and the pool's rows, garbage included, are left as they were."""
    from kernels.metal.pool import MLXKVPool
    from kvstore.pool import KVPool
    rng = np.random.default_rng(16)
    Dl, Dr, H = 64, 16, 3
    pools = [cls(1, Dl, Dr, tier, n_blocks=6, block_size=4, max_slots=2) for cls in (KVPool, MLXKVPool)]
    L = (rng.standard_normal((7, Dl)) * 40).astype(np.float32)
    R = rng.standard_normal((7, Dr)).astype(np.float32)
    for p in pools:
        s = p.alloc_slot()
        p.write(0, [s] * 7, np.arange(7), L, R)
        p.write(0, [], [], L[:0], R[:0])
    ql = np.full((0, H, Dl), np.nan, np.float32)
    qr = np.full((0, H, Dr), np.nan, np.float32)
    ref = pools[0].attend(0, [], [], ql, qr, 0.1)
    got = pools[1].attend(0, np.zeros(0, np.int64), np.zeros(0, np.int64), mx.array(ql), mx.array(qr), 0.1)
    assert ref.shape == tuple(got.shape) == (0, H, Dl)
    same_coded_rows(pools, [0], layer=0)
    q = rng.standard_normal((1, H, Dl)).astype(np.float32)
    qrr = rng.standard_normal((1, H, Dr)).astype(np.float32)
    check_close(np.array(pools[1].attend(0, [0], [6], mx.array(q), mx.array(qrr), 0.1)),
                pools[0].attend(0, [0], [6], q, qrr, 0.1).astype(np.float64))
