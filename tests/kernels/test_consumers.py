"""Native consumers against decode-then-attend (float64), with hostile planes."""
import re

import numpy as np
import pytest

from kernels.cpu import consumers, fp8, polar, tq4
from kernels.cpu.codecs import decode_rows, encode_rows
from kernels.tiers import TierError, get_tier

TIERS = ["f32", "kv8", "tq4"] + [f"polar{b}" for b in range(2, 7)]


def plane(tier, rows, n, rng):
    """A code plane with garbage in the rows that are not passed: NaN rows through the codec
    (which makes them inert), random bytes and NaN/Inf scales in the unused rows."""
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32)
    x[rows // 2] = np.nan
    codes, scales = encode_rows(tier, x)
    unused = rng.permutation(rows)[: rows // 3]
    if not tier.quantized:  # f32 keeps the NaN row as it is: it must not be passed
        unused = np.union1d(unused, [rows // 2])
    if codes.dtype == np.uint8:
        codes[unused] = rng.integers(0, 256, codes[unused].shape, dtype=np.uint8)
    else:
        codes[unused] = np.nan
    scales[unused] = np.where(rng.random(len(unused)) < 0.5, np.nan, np.inf)
    used = np.setdiff1d(rng.permutation(rows), unused)
    rng.shuffle(used)
    return codes, scales, used


COUNT = consumers.WorkCounter()  # polar rows rebuilt by the consumers in this module


def rel_err(got, ref):
    assert got.shape == ref.shape and np.all(np.isfinite(got))
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("n", [512, 64])
@pytest.mark.parametrize("name", TIERS)
def test_equal_to_decode_then_attend(name, n):
    rng = np.random.default_rng(hash((name, n)) % 2**32)
    tier = get_tier(name)
    codes, scales, used = plane(tier, 300, n, rng)
    c, s = codes[used], scales[used]  # shuffled, only the live rows
    rows = decode_rows(tier, c, s, n).astype(np.float64)
    assert np.all(np.isfinite(rows))
    q = rng.standard_normal((7, n)).astype(np.float32)
    p = rng.random((7, len(used))).astype(np.float32)
    assert rel_err(consumers.scores(tier, q, c, s, COUNT), q.astype(np.float64) @ rows.T) < 1e-5
    assert rel_err(consumers.context(tier, p, c, s, n, COUNT), p.astype(np.float64) @ rows) < 1e-5


@pytest.mark.parametrize("name", TIERS)
def test_batched_leading_axis(name):
    rng = np.random.default_rng(7)
    tier = get_tier(name)
    B, M, T, n = 3, 4, 50, 128
    x = rng.standard_normal((B, T, n)).astype(np.float32)
    c, s = encode_rows(tier, x)
    c[1, 40:], s[1, 40:] = 0, 0  # masked tail as the attention passes it: code 0, scale 0
    rows = decode_rows(tier, c, s, n).astype(np.float64)
    q = rng.standard_normal((B, M, n)).astype(np.float32)
    p = rng.random((B, M, T)).astype(np.float32)
    got_s = consumers.scores(tier, q, c, s, COUNT)
    got_c = consumers.context(tier, p, c, s, n, COUNT)
    assert got_s.shape == (B, M, T) and got_c.shape == (B, M, n)
    assert rel_err(got_s, np.einsum("bmn,btn->bmt", q, rows)) < 1e-5
    assert rel_err(got_c, np.einsum("bmt,btn->bmn", p, rows)) < 1e-5
    assert np.all(got_s[1, :, 40:] == 0)


@pytest.mark.parametrize("name", ["kv8", "tq4"])
def test_fp8_and_tq4_never_decode_rows(name, monkeypatch):
    """The native paths read codes through the tables only: decoding a row is an error."""
    def boom(*a, **k):
        raise AssertionError("a native consumer decoded rows")
    for mod, fn in [(fp8, "decode"), (tq4, "decode"), (tq4, "decode_rotated"), (polar, "decode"),
                    (polar, "decode_rotated"), (polar, "decode_rotated_columns")]:
        monkeypatch.setattr(mod, fn, boom)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    c, s = encode_rows(name, x)
    before = COUNT.value
    consumers.scores(get_tier(name), x[:2], c, s, COUNT)
    consumers.context(get_tier(name), np.ones((2, 64), np.float32), c, s, 256, COUNT)
    assert COUNT.value == before


def test_polar_rebuilds_are_counted():
    rng = np.random.default_rng(2)
    tier = get_tier("polar3")
    x = rng.standard_normal((2, 30, 64)).astype(np.float32)
    c, s = encode_rows(tier, x)
    before = COUNT.value
    consumers.scores(tier, rng.standard_normal((2, 5, 64)).astype(np.float32), c, s, COUNT)
    assert COUNT.value == before + 60
    consumers.context(tier, rng.random((2, 5, 30)).astype(np.float32), c, s, 64, COUNT)
    assert COUNT.value == before + 120


def test_inert_width_and_bad_radius_read_as_zero():
    tier = get_tier("tq4")
    c = np.full((5, 3), 0xAB, np.uint8)  # width 6 is not a power of two: inert
    s = np.ones(5, np.float32)
    assert np.all(consumers.scores(tier, np.ones((2, 6), np.float32), c, s, COUNT) == 0)
    assert np.all(consumers.context(tier, np.ones((2, 5), np.float32), c, s, 6, COUNT) == 0)
    rng = np.random.default_rng(3)
    c, s = encode_rows(tier, rng.standard_normal((4, 32)).astype(np.float32))
    s[:] = [np.nan, np.inf, -1.0, 0.0]
    for name in ("tq4", "polar4"):
        cc, _ = encode_rows(name, rng.standard_normal((4, 32)).astype(np.float32))
        assert np.all(consumers.scores(get_tier(name), np.ones((1, 32), np.float32), cc, s, COUNT) == 0)
        assert np.all(consumers.context(get_tier(name), np.ones((1, 4), np.float32), cc, s, 32, COUNT) == 0)


def test_polar_consumers_refuse_to_rebuild_uncounted():
    tier = get_tier("polar4")
    c, s = encode_rows(tier, np.ones((3, 64), np.float32))
    with pytest.raises(ValueError, match="counter"):
        consumers.scores(tier, np.ones((1, 64), np.float32), c, s)
    with pytest.raises(ValueError, match="counter"):
        consumers.context(tier, np.ones((1, 3), np.float32), c, s, 64)


@pytest.mark.parametrize("name", ["tq4", "polar3", "kv8", "f32"])
def test_consumers_refuse_codes_of_another_width(name):
    """(tq4's context unrotated at the codes' width and returned [.., 64] for n = 32)"""
    tier = get_tier(name)
    c, s = encode_rows(tier, np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32))
    with pytest.raises(TierError, match=rf"{name}: codes shape \(5, {c.shape[-1]}\)"):
        consumers.context(tier, np.ones((1, 5), np.float32), c, s, 32, COUNT)
    with pytest.raises(TierError, match=rf"q.shape\[-1\]=32"):
        consumers.scores(tier, np.ones((1, 32), np.float32), c, s, COUNT)


@pytest.mark.parametrize("name", ["tq4", "polar3", "kv8"])
def test_consumers_want_one_scale_per_row(name):
    """(scales of shape (1,) broadcast the first row's scale over every row for kv8 and tq4)"""
    tier = get_tier(name)
    c, s = encode_rows(tier, np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32))
    for bad in (s[:1], s[:, None]):
        with pytest.raises(TierError, match=rf"{name}: scales shape {re.escape(str(bad.shape))}"):
            consumers.scores(tier, np.ones((1, 64), np.float32), c, bad, COUNT)
        with pytest.raises(TierError, match=rf"{name}: scales shape"):
            consumers.context(tier, np.ones((1, 4), np.float32), c, bad, 64, COUNT)
