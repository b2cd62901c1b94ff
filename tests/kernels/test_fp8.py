"""kv8 (fp8 e4m3fn) codec against the DESIGN.md contract, value by value."""
import ml_dtypes
import numpy as np
import pytest

from kernels.cpu import fp8
from kernels.cpu.codecs import decode_rows, encode_rows
from kernels.tiers import TierError

FINITE = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)


def enc1(v):
    return int(fp8.enc(np.array([v], dtype=np.float32))[0])


def test_decode_table_matches_ml_dtypes_and_nans_read_zero():
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(fp8.DECODE_TABLE[FINITE], ref[FINITE])
    assert fp8.DECODE_TABLE[0x7F] == 0 and fp8.DECODE_TABLE[0xFF] == 0
    assert fp8.DECODE_TABLE[0x7E] == 448 and fp8.DECODE_TABLE[0x01] == 2.0 ** -9


def test_pair_gather_equals_table():
    codes = np.random.default_rng(4).integers(0, 256, (3, 7, 64), dtype=np.uint8)
    assert np.array_equal(fp8.table_values(codes), fp8.DECODE_TABLE[codes])
    assert np.array_equal(fp8.table_values(codes[..., :63]), fp8.DECODE_TABLE[codes[..., :63]])
    assert np.array_equal(fp8.table_values(codes[:, ::2]), fp8.DECODE_TABLE[codes[:, ::2]])


def test_all_254_finite_codes_round_trip():
    values = fp8.DECODE_TABLE[FINITE]
    assert np.array_equal(fp8.enc(values), FINITE)
    assert np.array_equal(fp8.enc_reference(values), FINITE)
    # through the row path: amax = 448 makes inv = 1 and scale = 1
    rows = np.stack([values, np.full_like(values, 448.0)], axis=1)
    codes, scales = fp8.encode(rows)
    assert np.array_equal(codes[:, 0], FINITE) and np.all(codes[:, 1] == 0x7E)
    assert np.all(scales == 1.0)
    assert np.array_equal(fp8.decode(codes, scales)[:, 0], values)


@pytest.mark.parametrize("value,expect", [(17.0, 16.0), (19.0, 20.0), (15.5, 16.0), (14.5, 14.0),
                                          (-17.0, -16.0), (-14.5, -14.0), (0.5 + 2**-5, 0.5),
                                          (0.5 + 3 * 2**-5, 0.5 + 2**-3)])
def test_round_half_even_ties_under_unit_scale(value, expect):
    codes, scales = fp8.encode(np.array([[value, 448.0, -3.0]], dtype=np.float32))
    assert scales[0] == 1.0
    assert fp8.DECODE_TABLE[codes[0, 0]] == expect


def test_saturation_inf_nan_and_signed_zero():
    assert enc1(448.0) == 0x7E and enc1(-448.0) == 0xFE
    assert enc1(449.0) == 0x7E and enc1(463.9) == 0x7E and enc1(464.0) == 0x7E
    assert enc1(1e30) == 0x7E and enc1(-3e38) == 0xFE
    assert enc1(np.inf) == 0x7E and enc1(-np.inf) == 0xFE
    assert enc1(np.nan) == 0x00 and enc1(-np.nan) == 0x00
    assert enc1(np.float32(np.copysign(np.nan, -1))) == 0x00
    assert enc1(0.0) == 0x00 and enc1(-0.0) == 0x80
    assert enc1(416.0) == 0x7D and enc1(432.0) == 0x7E  # 432 ties 416|448: 448 has even k


def test_subnormals():
    s = 2.0 ** -9
    assert enc1(s) == 0x01 and enc1(-s) == 0x81 and enc1(7 * s) == 0x07
    assert enc1(0.5 * s) == 0x00 and enc1(-0.5 * s) == 0x80  # tie to even 0
    assert enc1(1.5 * s) == 0x02 and enc1(2.5 * s) == 0x02 and enc1(3.5 * s) == 0x04
    assert enc1(7.5 * s) == 0x08  # rounds up into the smallest normal 2^-6
    assert enc1(1e-45) == 0x00 and enc1(np.float32(2.0 ** -6)) == 0x08
    assert enc1(np.nextafter(np.float32(2.0 ** -6), np.float32(0))) == 0x08


def _hostile_values(rng):
    table = fp8.DECODE_TABLE[FINITE].astype(np.float64)
    srt = np.unique(table)
    mids = ((srt[1:] + srt[:-1]) / 2).astype(np.float32)  # exact ties (all representable)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(-np.inf))])
    wide = (rng.standard_normal(200_000) * np.exp(rng.uniform(-25, 7, 200_000))).astype(np.float32)
    special = np.array([0, -0.0, np.inf, -np.inf, np.nan, 448, 464, 480, 1e-40, -1e-45,
                        2.0 ** -6, 2.0 ** -10, 3.4e38], dtype=np.float32)
    return np.concatenate([mids, -mids, near, -near, wide, special, table.astype(np.float32)])


def test_fast_enc_equals_literal_contract():
    v = _hostile_values(np.random.default_rng(1))
    assert np.array_equal(fp8.enc(v), fp8.enc_reference(v))


def test_agrees_with_ml_dtypes_on_non_saturating_values():
    v = _hostile_values(np.random.default_rng(2))
    ok = ~np.isnan(v) & (np.abs(v) < 464)
    ref = v[ok].astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(fp8.enc(v[ok]), ref)


def test_row_amax_rule_and_inert_rows():
    x = np.array([[np.nan, 2.0, -4.0, 1.0],      # NaN does not raise amax
                  [1.0, np.inf, 2.0, 3.0],        # Inf row: inert
                  [0.0, -0.0, 0.0, 0.0],          # zero row: inert
                  [1e-36, -1e-38, 0, 1e-40],      # tiny amax: inert
                  [np.nan] * 4,                   # all NaN: inert
                  [3.0e38, 3.4028e38, 1.0, 0.0],  # amax > 3.4e38: inert
                  [1e-34, -2e-34, 0.0, 5e-35],    # tiny but live
                 [1e-35, 0.0, -1e-35, 0.0]],     # amax == 1e-35f: not > 1e-35f, inert
                 dtype=np.float32)
    codes, scales = fp8.encode(x)
    assert codes[0, 0] == 0 and scales[0] == np.float32(4.0) / np.float32(448.0)
    assert codes[0, 2] == 0xFE and fp8.DECODE_TABLE[codes[0, 1]] == 224.0
    for r in [1, 2, 3, 4, 5, 7]:
        assert np.all(codes[r] == 0) and scales[r] == 1.0, r
    assert scales[6] == np.float32(2e-34) / np.float32(448.0) and codes[6, 1] == 0xFE
    dec = fp8.decode(codes, scales)
    assert np.all(dec[1:6] == 0) and np.all(dec[7] == 0)
    np.testing.assert_allclose(dec[6], x[6], rtol=0.07)


def test_codec_dispatch_any_leading_shape_and_error():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * 10
    codes, scales = encode_rows("kv8", x)
    assert codes.shape == (3, 5, 64) and codes.dtype == np.uint8 and scales.shape == (3, 5)
    flat_codes, flat_scales = fp8.encode(x.reshape(15, 64))
    assert np.array_equal(codes.reshape(15, 64), flat_codes)
    y = decode_rows("kv8", codes, scales, 64)
    rel = np.linalg.norm(y - x, axis=-1) / np.linalg.norm(x, axis=-1)
    assert y.shape == x.shape and rel.max() < 0.04
    # big enough to cross the encoder's block size: blocks must not change the result
    big = rng.standard_normal((700, 512)).astype(np.float32)
    c_big, s_big = fp8.encode(big)
    assert np.array_equal(c_big[650:], fp8.encode(big[650:])[0])
    assert np.array_equal(s_big[:3], fp8.encode(big[:3])[1])


def test_strided_sweep_of_float32_bit_patterns():
    """Every 211th float32 bit pattern up to 464 (both signs): all exponents, dense mantissas."""
    bits = np.arange(0, 0x43E80000, 211, dtype=np.uint32)
    v = np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)
    fast = fp8.enc(v)
    assert np.array_equal(fast, v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert np.array_equal(fast[::7], fp8.enc_reference(v[::7]))


@pytest.mark.parametrize("name", ["kv8", "tq4", "polar3", "f32"])
def test_decode_rows_refuses_codes_a_cast_would_change(name):
    """(np.asarray(codes, uint8) wrapped 256 -> 0 and -1 -> 0xFF, truncated float codes, and
    the f32 tier read uint8 bytes as values: all decoded without an error)"""
    x = np.random.default_rng(5).standard_normal((3, 16)).astype(np.float32)
    codes, scales = encode_rows(name, x)
    want = decode_rows(name, codes, scales, 16)
    if name == "f32":
        assert np.array_equal(decode_rows(name, codes.astype(np.float64), scales, 16), want)
        off = codes.astype(np.float64)
        off[0, 0] += 1e-12  # a float64 value float32 cannot hold would be rounded
        bad = [codes.view(np.uint8)[:, :16], codes.astype(np.int32), off]
    else:
        assert np.array_equal(decode_rows(name, codes.astype(np.int64), scales, 16), want)
        bad = [codes.astype(np.int64) + 256, codes.astype(np.int16) - 1 - codes.max(),
               codes.astype(np.float32)]
    for c in bad:
        with pytest.raises(TierError, match=rf"{name}: codes must be"):
            decode_rows(name, c, scales, 16)
