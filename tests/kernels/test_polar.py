"""polarB codecs: a literal per-row transcription of DESIGN.md with an explicit bit cursor."""
import math

import numpy as np
import pytest

from kernels.cpu import polar, rotation, tq4
from kernels.cpu.codecs import decode_rows, encode_rows
from kernels.tiers import get_tier
from wide_decode import assert_decodes_like_f64, unrotate_f64

PI = np.float32(math.pi)


def encode_literal(row, B):
    n = len(row)
    nbytes = get_tier(f"polar{B}").row_bytes(n)
    out = bytearray(nbytes)
    norm = tq4.row_norms(row[None])[0]
    if not (norm > np.float32(1e-35)) or norm > np.float32(3.4e38) or not rotation.rotatable(n):
        return np.frombuffer(bytes(out), np.uint8), np.float32(0)
    r = list(rotation.rotate(row[None])[0])
    cursor, level = 0, 1
    while len(r) > 1:
        nxt = []
        b = B if level == 1 else max(1, B - 1)
        for j in range(len(r) // 2):
            a, c = np.float32(r[2 * j]), np.float32(r[2 * j + 1])
            angle = np.arctan2(c, a)
            nxt.append(np.hypot(a, c))
            if level == 1:
                t = (angle + PI) * (np.float32(0.5) / PI) * np.float32(2 ** b)
            else:
                w = min(np.float32(1.5) / np.sqrt(np.float32(2 ** (level - 1))), PI / np.float32(4))
                t = (angle - (PI / np.float32(4) - w)) / (np.float32(2) * w) * np.float32(2 ** b)
            q = int(min(max(math.floor(t), 0), 2 ** b - 1))
            for k in range(b):  # LSB first at the running cursor
                if (q >> k) & 1:
                    out[cursor // 8] |= 1 << (cursor % 8)
                cursor += 1
        r, level = nxt, level + 1
    return np.frombuffer(bytes(out), np.uint8), norm


def gaussian(rows, n, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, n)).astype(np.float32)


@pytest.mark.parametrize("B", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("n", [2, 4, 32, 128])
def test_codes_equal_literal_contract(B, n):
    x = gaussian(6, n, seed=B * n) * np.float32(3.0)
    x[2] = 0
    codes, radius = polar.encode(x, B)
    assert codes.shape == (6, get_tier(f"polar{B}").row_bytes(n))
    for r in range(6):
        c, s = encode_literal(x[r], B)
        assert np.array_equal(codes[r], c), (r, codes[r], c)
        assert radius[r] == s


@pytest.mark.parametrize("B", range(2, 7))
def test_byte_counts(B):
    tier = get_tier(f"polar{B}")
    for k in range(1, 12):
        n = 2 ** k
        assert polar.stream_bits(n, B) == (n // 2) * B + (n // 2 - 1) * max(1, B - 1)
        c, s = encode_rows(tier, gaussian(2, n))
        assert c.shape == (2, tier.row_bytes(n)) and c.dtype == np.uint8
    assert tier.token_bytes(512, 64) == {2: 116, 3: 188, 4: 260, 5: 332, 6: 404}[B]


def test_error_decreases_with_bits():
    x = gaussian(300, 512, seed=1)
    errs = []
    for B in range(2, 7):
        c, s = encode_rows(f"polar{B}", x)
        y = decode_rows(f"polar{B}", c, s, 512)
        errs.append(float(np.mean(np.linalg.norm(y - x, axis=1) / np.linalg.norm(x, axis=1))))
    assert all(a > b * 1.5 for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 0.05, errs


def read_literal(stream, n, B):
    """Codes per level (level 1 first) read back with an explicit LSB-first bit cursor."""
    bits = [(int(stream[i // 8]) >> (i % 8)) & 1 for i in range(8 * len(stream))]
    levels, cursor, count, level = [], 0, n // 2, 1
    while count >= 1:
        b = B if level == 1 else max(1, B - 1)
        codes = []
        for _ in range(count):
            codes.append(sum(bits[cursor + k] << k for k in range(b)))
            cursor += b
        levels.append(codes)
        count, level = count // 2, level + 1
    return levels


def test_decode_matches_literal_top_down():
    x = gaussian(3, 16, seed=2)
    codes, radius = polar.encode(x, 4)
    y = polar.decode(codes, radius, 16, 4)
    for row in range(3):
        fields = read_literal(codes[row], 16, 4)
        r = [radius[row]]
        for q, (count, b, lo, width) in zip(reversed(fields), reversed(polar.layout(16, 4))):
            c = [np.float32(lo) + (np.float32(v) + np.float32(0.5)) * np.float32(width) / np.float32(2 ** b)
                 for v in q]
            r = [val for j in range(count) for val in (r[j] * np.cos(c[j]), r[j] * np.sin(c[j]))]
        expect = rotation.unrotate(np.array(r, np.float32)[None])[0]
        assert np.array_equal(y[row], expect)


def test_deterministic_and_batch_independent():
    x = gaussian(700, 256, seed=3)  # crosses the block size of encode and decode
    c1, s1 = polar.encode(x, 3)
    c2, s2 = polar.encode(x, 3)
    assert np.array_equal(c1, c2) and np.array_equal(s1, s2)
    c3, s3 = polar.encode(x[690:], 3)
    assert np.array_equal(c1[690:], c3) and np.array_equal(s1[690:], s3)
    y = polar.decode(c1, s1, 256, 3)
    assert np.array_equal(y[690:], polar.decode(c3, s3, 256, 3))
    assert np.array_equal(y[:5], polar.decode(c1[:5], s1[:5], 256, 3))


def test_inert_rows_and_bad_radius():
    x = gaussian(6, 64, seed=4)
    x[0] = 0
    x[1, 3] = np.nan
    x[2, 1] = -np.inf
    x[3] = np.float32(1e-41)
    codes, radius = polar.encode(x, 5)
    assert np.all(codes[:4] == 0) and np.all(radius[:4] == 0) and np.all(radius[4:] > 0)
    assert np.all(polar.decode(codes, radius, 64, 5)[:4] == 0)
    bad = np.float32([np.nan, np.inf, -2.0, 0.0, 1.0, 1.0])
    y = polar.decode(codes, bad, 64, 5)
    assert np.all(y[:4] == 0) and np.all(np.isfinite(y))
    c, s = encode_rows("polar2", gaussian(2, 12))
    assert np.all(c == 0) and np.all(s == 0) and np.all(decode_rows("polar2", c, s, 12) == 0)


@pytest.mark.parametrize("B", [2, 4, 6])
@pytest.mark.parametrize("n", [2, 64, 2048])
def test_decode_radius_at_float32_max(B, n):
    """A hostile radius at float32 max decodes to the rounded true values, never NaN (the
    inverse rotation's partial sums used to overflow); see test_tq4's test of the same name."""
    rng = np.random.default_rng(B * n)
    width = get_tier(f"polar{B}").row_bytes(n)
    codes = rng.integers(0, 256, (5, width)).astype(np.uint8)
    fmax = np.finfo(np.float32).max
    radius = np.float32([fmax, fmax, 3.4e38, 1e38, 2.0 ** 100])
    y = polar.decode(codes, radius, n, B)
    # the polar tree never overflows (|cos|, |sin| <= 1); rebuild it at radius 1 and scale
    # in float64, then the exact inverse rotation
    unit = polar.decode_rotated(codes, np.ones(5, np.float32), n, B).astype(np.float64)
    assert_decodes_like_f64(y, unrotate_f64(unit * radius.astype(np.float64)[:, None]))


@pytest.mark.parametrize("B", [2, 5])
def test_decode_of_large_radii_keeps_the_contract_order_bit_for_bit(B):
    n = 256
    rng = np.random.default_rng(B)
    codes = rng.integers(0, 256, (2000, get_tier(f"polar{B}").row_bytes(n))).astype(np.uint8)
    radius = (2.0 ** rng.uniform(-116, 124, 2000)).astype(np.float32)
    radius[:20] = np.float32(2.0 ** 64)
    with np.errstate(over="ignore", invalid="ignore"):
        literal = rotation.unrotate(polar.decode_rotated(codes, radius, n, B))
    ok = np.isfinite(literal).all(axis=1)
    assert ok.sum() > 1900
    got = polar.decode(codes, radius, n, B)
    assert np.array_equal(got[ok].view(np.uint32), literal[ok].view(np.uint32))
