"""kernels/cpu/attention.paged_mla_attention: bad inputs are named errors, never garbage."""
import numpy as np
import pytest

from kernels.cpu import consumers
from kernels.cpu.attention import LayerPlanes, paged_mla_attention
from kernels.cpu.codecs import encode_rows
from kernels.tiers import TierError, get_tier

DL, DR, H, BS = 64, 16, 2, 8


def _planes(name, n_blocks=6, dl=DL, dr=DR, seed=0):
    """Every pool position holds a coded hostile row (NaN planes would hide nothing here)."""
    rng = np.random.default_rng(seed)
    lc, ls = encode_rows(name, (rng.standard_normal((n_blocks, BS, dl)) * 3).astype(np.float32))
    rc, rs = encode_rows(name, (rng.standard_normal((n_blocks, BS, dr)) * 3).astype(np.float32))
    return LayerPlanes(lc, ls, rc, rs)


def _queries(dl=DL, dr=DR, B=2, Q=1, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Q, H, dl)).astype(np.float32),
            rng.standard_normal((B, Q, H, dr)).astype(np.float32))


TABLES = np.array([[4, 1], [0, -1]], np.int32)  # slot 0: 2 blocks (16 tokens), slot 1: 1 block


@pytest.mark.parametrize("name,dl", [("polar3", 32), ("polar2", 32), ("tq4", 32), ("tq4", 48),
                                     ("polar4", 48), ("kv8", 48), ("f32", 32)])
def test_query_width_must_match_the_planes(name, dl):
    """(a polar stream read at a narrower width attended to garbage; tq4/polar at a width the
    rotation cannot take returned zeros; neither raised)"""
    ql, qr = _queries(dl=dl)
    with pytest.raises(ValueError, match=rf"planes.l_codes has shape .* for q_lat width {dl}"):
        paged_mla_attention(name, _planes(name), TABLES, ql, qr, np.array([[9], [3]]), 0.1,
                            consumers.WorkCounter())


def test_rope_width_and_scale_planes_must_match():
    ql, qr = _queries(dr=8)
    with pytest.raises(ValueError, match="planes.r_codes"):
        paged_mla_attention("polar3", _planes("polar3"), TABLES, ql, qr, np.array([[9], [3]]),
                            0.1, consumers.WorkCounter())
    p = _planes("kv8")
    p.l_scale = p.l_scale[:, :-1]
    ql, qr = _queries()
    with pytest.raises(ValueError, match="planes.l_scale"):
        paged_mla_attention("kv8", p, TABLES, ql, qr, np.array([[9], [3]]), 0.1)


def test_positions_past_the_block_table_are_an_error():
    """(keys past the table's 2 x 8 tokens were dropped: q_pos 20 attended to 16 keys)"""
    ql, qr = _queries()
    with pytest.raises(ValueError, match=r"q_pos\[0\] reaches position 20, past the 16 tokens"):
        paged_mla_attention("kv8", _planes("kv8"), TABLES, ql, qr, np.array([[20], [3]]), 0.1)
    out = paged_mla_attention("kv8", _planes("kv8"), TABLES, ql, qr, np.array([[15], [3]]), 0.1)
    assert np.isfinite(out).all()


def test_block_ids_past_the_pool_are_named():
    ql, qr = _queries()
    bad = np.array([[4, 9], [0, 99]], np.int32)  # slot 1's 99 lies past its keys: never read
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 9 is past the pool's 6 blocks"):
        paged_mla_attention("f32", _planes("f32"), bad, ql, qr, np.array([[12], [3]]), 0.1)
    good = paged_mla_attention("f32", _planes("f32"), bad, ql, qr, np.array([[7], [3]]), 0.1)
    want = paged_mla_attention("f32", _planes("f32"), TABLES, ql, qr, np.array([[7], [3]]), 0.1)
    assert np.array_equal(good, want)


def test_no_queries():
    ql, qr = _queries(Q=0)
    out = paged_mla_attention("kv8", _planes("kv8"), TABLES, ql, qr, np.zeros((2, 0), int), 0.1)
    assert out.shape == (2, 0, H, DL)


@pytest.mark.parametrize("name", ["f32", "kv8", "tq4", "polar3"])
def test_a_nan_query_gives_nan_not_zeros(name):
    """A NaN in one head's query makes that head's context NaN, as the GPU and MLX paths
    give it; numpy's divide (where the denominator is > 0) used to hide it as zeros. Other
    heads, and a row that sees no key, are unchanged."""
    ql, qr = _queries()
    pos = np.array([[9], [3]])
    want = paged_mla_attention(name, _planes(name), TABLES, ql, qr, pos, 0.1, consumers.WorkCounter())
    ql[0, 0, 1, 5] = np.nan
    got = paged_mla_attention(name, _planes(name), TABLES, ql, qr, pos, 0.1, consumers.WorkCounter())
    assert np.isnan(got[0, 0, 1]).all()
    np.testing.assert_array_equal(got[0, 0, 0], want[0, 0, 0])
    np.testing.assert_array_equal(got[1], want[1])
    none = paged_mla_attention(name, _planes(name), TABLES, ql, qr, np.array([[-1], [3]]), 0.1,
                               consumers.WorkCounter())
    assert (none[0] == 0).all()  # row 0 sees no key: zeros, NaN query or not
