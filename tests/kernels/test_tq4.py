"""tq4 codec against a literal transcription of the DESIGN.md contract."""
import numpy as np
import pytest

from kernels.cpu import rotation, tq4
from kernels.cpu.codecs import decode_rows, encode_rows
from wide_decode import assert_decodes_like_f64, unrotate_f64


def norm_py(row):
    s = 0.0
    for v in row:  # float64, left to right, as the C loop
        s += float(v) * float(v)
    return np.float32(np.sqrt(s))


def encode_literal(row):
    """One row, step by step: norm, inert rule, rotate, 16-way float32 scan, nibbles."""
    n = len(row)
    norm = norm_py(row)
    if not (norm > np.float32(1e-35)) or norm > np.float32(3.4e38) or not rotation.rotatable(n):
        return np.zeros(n // 2, np.uint8), np.float32(0)
    y = rotation.rotate(row[None])[0]
    invstd = np.sqrt(np.float32(n)) / norm
    v = y * invstd
    d = np.abs(v[:, None] - tq4.LEVELS[None, :])  # float32 distances
    code = np.argmin(d, axis=1)  # first minimum = lower index on a tie
    packed = np.array([code[i] | (code[i + 1] << 4) for i in range(0, n, 2)], np.uint8)
    return packed, norm


def gaussian(rows, n, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32)


def rel_l2(tier, x):
    c, s = encode_rows(tier, x)
    y = decode_rows(tier, c, s, x.shape[-1])
    return float(np.mean(np.linalg.norm(y - x, axis=1) / np.linalg.norm(x, axis=1)))


@pytest.mark.parametrize("n", [2, 4, 16, 64, 512])
def test_codes_equal_literal_contract(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((24, n)) * np.exp(rng.uniform(-30, 30, (24, 1)))).astype(np.float32)
    x[3] = 0
    x[4, 0] = np.nan
    codes, radius = tq4.encode(x)
    for r in range(24):
        c, s = encode_literal(x[r])
        assert np.array_equal(codes[r], c), r
        assert radius[r] == s or (np.isnan(s) and radius[r] == 0), r


def test_nearest_level_equals_full_scan_including_ties():
    L = tq4.LEVELS
    mids = (L[1:] + L[:-1]) / np.float32(2)
    v = np.concatenate([L, mids, np.nextafter(mids, np.float32(9)), np.nextafter(mids, np.float32(-9)),
                        np.linspace(-4, 4, 4001, dtype=np.float32),
                        np.array([0.0, -0.0, 1e-30, 45.3, -45.3, np.inf, -np.inf, np.nan], np.float32)])
    with np.errstate(invalid="ignore"):
        scan = np.argmin(np.abs(v[:, None] - L[None, :]), axis=1)
    scan[np.isnan(v)] = 0  # argmin of an all-NaN row is 0 as well; made explicit
    assert np.array_equal(tq4.nearest_level(v), scan)
    assert tq4.nearest_level(np.float32([0.0]))[0] == 7  # |0 - -0.128| == |0 - 0.128|


def test_radius_is_exact_sequential_float64_norm():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((40, 256)) * np.exp(rng.uniform(-20, 20, (40, 256)))).astype(np.float32)
    _, radius = tq4.encode(x)
    assert np.array_equal(radius, np.array([norm_py(r) for r in x], np.float32))


@pytest.mark.parametrize("tier", ["tq4", "polar3"])
def test_radius_is_sequential_for_a_lone_row_too(tier):
    """A row whose pairwise float64 sum rounds differently from the sequential one: alone, in
    a batch, as the single row of a batch's last block (257 rows), and given in column
    order, its radius is the contract's (numpy sums a lone column pairwise)."""
    x = np.full(128, 2.0 ** -27, np.float32)
    x[0], x[1], x[2] = 1.0, 2.0 ** -12, 2.0 ** -12
    want = norm_py(x)
    assert want.view(np.uint32) == 0x3F800000
    for rows in (1, 2, 3, 257):
        batch = np.repeat(x[None], rows, axis=0)
        _, radius = encode_rows(tier, batch)
        assert np.array_equal(radius.view(np.uint32), np.full(rows, want).view(np.uint32)), rows
    assert tq4.column_norms(np.asfortranarray(np.repeat(x[:, None], 3, axis=1)))[2] == want


def test_nibble_order_low_nibble_is_even_index():
    x = gaussian(5, 32, seed=7)
    codes, _ = tq4.encode(x)
    levels = tq4.unpack_levels(codes)
    assert np.array_equal(levels[:, 0::2], tq4.LEVELS[codes & 0xF])
    assert np.array_equal(levels[:, 1::2], tq4.LEVELS[codes >> 4])


def test_gaussian_relative_error_matches_lloyd_max():
    err = rel_l2("tq4", gaussian(2000, 512))
    assert abs(err - 0.0975) <= 0.003 and err <= 0.0980, err


def test_beats_polar3_and_polar4():
    x = gaussian(300, 512, seed=11)
    e = {t: rel_l2(t, x) for t in ("tq4", "polar3", "polar4")}
    assert e["tq4"] < e["polar4"] < e["polar3"], e


@pytest.mark.parametrize("n", [2, 64, 2048])
def test_one_hot_rows(n):
    x = np.zeros((3, n), np.float32)
    x[0, 0], x[1, n // 2], x[2, n - 1] = 3.0, -0.25, 1e20
    codes, radius = tq4.encode(x)
    assert np.array_equal(radius, np.float32([3.0, 0.25, 1e20]))
    y = tq4.decode(codes, radius, n)
    # rotated one-hots are +-|x|/sqrt(n) everywhere: v = +-1, nearest level +-0.942
    scale = np.abs(x).max(1, keepdims=True)
    np.testing.assert_allclose(y / scale, np.float32(0.942) * x / scale, atol=2e-6)


def test_inert_rows_and_widths():
    x = gaussian(7, 64, seed=3)
    x[0] = 0
    x[1, 5] = np.nan
    x[2, 9] = np.inf
    x[3] = np.float32(1e-40)                      # subnormal: norm 8e-40 < 1e-35
    x[4] = 0; x[4, 0] = np.float32(3.4028e38)     # norm > 3.4e38
    x[5] = 0; x[5, 7] = np.float32(1e-35)         # norm == 1e-35f exactly: not > 1e-35f
    codes, radius = tq4.encode(x)
    assert np.all(codes[:6] == 0) and np.all(radius[:6] == 0)
    assert np.all(radius[6:] > 0)
    y = tq4.decode(codes, radius, 64)
    assert np.all(y[:6] == 0) and np.all(np.isfinite(y))
    for n in (6, 10, 4096):  # not a power of two in 2..2048
        c, s = encode_rows("tq4", gaussian(3, n))
        assert c.shape == (3, n // 2) and np.all(c == 0) and np.all(s == 0)
        assert np.all(decode_rows("tq4", c, s, n) == 0)


def test_decode_rejects_bad_radius():
    x = gaussian(4, 128, seed=4)
    codes, radius = tq4.encode(x)
    radius = np.float32([np.nan, np.inf, -1.0, 0.0])
    assert np.all(tq4.decode(codes, radius, 128) == 0)


def test_any_leading_shape_and_determinism():
    x = gaussian(2 * 3 * 5, 256, seed=8).reshape(2, 3, 5, 256)
    c, s = encode_rows("tq4", x)
    assert c.shape == (2, 3, 5, 128) and s.shape == (2, 3, 5)
    c2, s2 = tq4.encode(x.reshape(-1, 256)[7:9])
    assert np.array_equal(c.reshape(-1, 128)[7:9], c2) and np.array_equal(s.reshape(-1)[7:9], s2)
    big = gaussian(1100, 256, seed=9)  # crosses the encoder's block size
    cb, sb = tq4.encode(big)
    assert np.array_equal(cb[1000:], tq4.encode(big[1000:])[0])
    y = decode_rows("tq4", c, s, 256)
    assert y.shape == x.shape


def test_signalling_nan_row_is_inert_without_a_warning():
    """A row holding a signalling NaN (0x7F800001) encodes as an inert row, as a quiet NaN's
    does, and the float64 norm's cast raises no RuntimeWarning on the way."""
    import warnings
    from kernels.cpu import codecs
    x = np.random.default_rng(21).standard_normal((3, 64)).astype(np.float32)
    x.view(np.uint32)[1, 9] = 0x7F800001
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codes, scales = codecs.encode_rows("tq4", x)
    q = x.copy()
    q[1, 9] = np.nan
    want_c, want_s = codecs.encode_rows("tq4", q)
    assert scales[1] == 0.0 and np.array_equal(codes, want_c) and np.array_equal(scales, want_s)


@pytest.mark.parametrize("n", [2, 64, 512, 2048])
def test_decode_radius_at_float32_max(n):
    """A radius at or near float32 max (only a hostile or corrupt file holds one: encode keeps
    radius <= 3.4e38) decodes to the rounded true values, not NaN: the butterfly's partial
    sums reach sqrt(n) times the row's largest value and used to overflow (Inf - Inf)."""
    rng = np.random.default_rng(n)
    codes = rng.integers(0, 256, (6, n // 2)).astype(np.uint8)
    codes[0] = 0x00                      # every level -2.733: entries past float32 max -> Inf
    codes[1] = 0x77                      # every level -0.128
    radius = np.float32([np.finfo(np.float32).max, np.finfo(np.float32).max,
                         np.finfo(np.float32).max, 3.4e38, 1e38, 2.0 ** 100])
    y = tq4.decode(codes, radius, n)
    step = radius.astype(np.float64) / np.sqrt(np.float32(n)).astype(np.float64)
    assert_decodes_like_f64(y, unrotate_f64(tq4.unpack_levels(codes) * step[:, None]))


@pytest.mark.parametrize("n", [2, 64, 2048])
def test_decode_of_large_radii_keeps_the_contract_order_bit_for_bit(n):
    """Rows whose contract-order decode stays finite keep exactly those bits, including the
    radii (>= 2^64) that decode takes through the scaled path."""
    rng = np.random.default_rng(n + 1)
    codes = rng.integers(0, 256, (3000, n // 2)).astype(np.uint8)
    radius = (2.0 ** rng.uniform(-116, 124, 3000)).astype(np.float32)
    radius[:20] = np.float32(2.0 ** 64)
    radius[20:40] = np.nextafter(np.float32(2.0 ** 64), np.float32(0))
    with np.errstate(over="ignore", invalid="ignore"):
        literal = rotation.unrotate(tq4.unpack_levels(codes) * tq4.step(radius, n)[:, None])
    ok = np.isfinite(literal).all(axis=1)
    assert ok.sum() > 2900
    got = tq4.decode(codes, radius, n)
    assert np.array_equal(got[ok].view(np.uint32), literal[ok].view(np.uint32))
