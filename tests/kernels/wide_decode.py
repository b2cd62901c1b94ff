"""Decode references in float64, where nothing a float32 row holds can overflow."""
import numpy as np

from kernels.cpu import rotation


def unrotate_f64(y):
    """D H(y) in float64 (no overflow for float32 inputs): the exact value decode rounds."""
    n = y.shape[-1]
    a = np.array(y, np.float64)
    h = 1
    while h < n:
        v = a.reshape(*a.shape[:-1], n // (2 * h), 2, h)
        v[..., 0, :], v[..., 1, :] = v[..., 0, :] + v[..., 1, :], v[..., 0, :] - v[..., 1, :]
        h *= 2
    return a / np.sqrt(n) * rotation.signs(n)


def assert_decodes_like_f64(y, want):
    """y (float32) is want (float64) rounded: no NaN, +-Inf exactly where |want| is past
    float32 max, and elsewhere within float32 rounding of the row's size."""
    fmax = float(np.finfo(np.float32).max)
    assert not np.isnan(y).any()
    over = np.abs(want) > fmax * (1 + 1e-5)
    fits = np.abs(want) < fmax * (1 - 1e-5)
    assert np.array_equal(y[over], np.copysign(np.inf, want[over]).astype(np.float32))
    assert np.isfinite(y[fits]).all()
    scale = np.abs(want).max(axis=-1, keepdims=True)
    err = np.where(fits, np.abs(y.astype(np.float64) - want), 0) / scale
    assert err.max() < 1e-5, err.max()

