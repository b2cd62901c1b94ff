"""The shared tq4/polar rotation: signs, butterfly order, orthogonality, inverse."""
import numpy as np
import pytest

from kernels.cpu import rotation

WIDTHS = [2 ** k for k in range(1, 12)]


def splitmix32_py(x):
    m = 0xFFFFFFFF
    x = (x + 0x9E3779B9) & m
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & m
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & m
    return x ^ (x >> 16)


def rotate_py(x):
    """One row, written as the C loop: D, in-place butterfly, then * (1/sqrtf(n)), float32."""
    n = len(x)
    a = [np.float32(v) * np.float32(-1.0 if splitmix32_py(0x9E3779B9 ^ i) & 1 else 1.0)
         for i, v in enumerate(x)]
    h = 1
    while h < n:
        for i in range(0, n, 2 * h):
            for j in range(i, i + h):
                u, w = a[j], a[j + h]
                a[j], a[j + h] = np.float32(u + w), np.float32(u - w)
        h *= 2
    inv = np.float32(1.0) / np.sqrt(np.float32(n))
    return np.array([np.float32(v * inv) for v in a], dtype=np.float32)


def test_signs_follow_splitmix32():
    d = rotation.signs(2048)
    expect = [-1.0 if splitmix32_py(0x9E3779B9 ^ i) & 1 else 1.0 for i in range(2048)]
    assert np.array_equal(d, np.array(expect, dtype=np.float32))
    assert 900 < (d < 0).sum() < 1150
    assert np.array_equal(rotation.signs(64), d[:64])


@pytest.mark.parametrize("n", [2, 8, 64, 256])
def test_bit_exact_against_scalar_c_order(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((4, n)) * np.exp(rng.uniform(-8, 8, (4, n)))).astype(np.float32)
    y = rotation.rotate(x)
    for r in range(4):
        assert np.array_equal(y[r], rotate_py(x[r]))


@pytest.mark.parametrize("n", WIDTHS)
def test_orthogonal_and_self_inverse(n):
    m = rotation.rotate(np.eye(n, dtype=np.float32)).astype(np.float64)  # rows = R e_i
    np.testing.assert_allclose(m @ m.T, np.eye(n), atol=2e-6)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, n)).astype(np.float32)
    y = rotation.rotate(x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    np.testing.assert_allclose(rotation.unrotate(y), x, atol=1e-5)
    np.testing.assert_allclose(rotation.rotate(rotation.unrotate(x)), x, atol=1e-5)
    # the leading shape is free
    assert np.array_equal(rotation.rotate(x.reshape(3, 1, n)).reshape(3, n), y)


def test_layouts_agree_bit_for_bit():
    """Many rows take the transposed (column) path; few rows the direct one."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((300, 512)).astype(np.float32)
    many = rotation.rotate(x)
    few = np.concatenate([rotation.rotate(x[i:i + 1]) for i in range(0, 300, 37)])
    assert np.array_equal(many[::37], few)


@pytest.mark.parametrize("n", [1, 3, 6, 12, 4096])
def test_bad_widths_rejected(n):
    assert not rotation.rotatable(n)
    with pytest.raises(ValueError, match="power of two"):
        rotation.rotate(np.ones((1, n), dtype=np.float32))


def test_no_codec_or_rotation_writes_into_its_input():
    """A one-row block's transpose is a view of the input: the in-place butterfly must
    still work on a copy (this once rotated the caller's decode rows in place)."""
    from kernels.cpu import codecs
    from kernels.cpu.rotation import rotate, unrotate
    from kernels.tiers import TIERS
    rng = np.random.default_rng(11)
    for rows in (1, 2, 300):
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        keep = x.copy()
        for tier in TIERS.values():
            codes, scales = codecs.encode_rows(tier, x)
            codecs.decode_rows(tier, codes, scales, 512)
        rotate(x)
        unrotate(x)
        np.testing.assert_array_equal(x, keep)
