"""GPU encoders write exactly the numpy reference's bytes (codes and scales, bit for bit)."""
import ctypes
import ctypes.util

import numpy as np
import pytest

cp = pytest.importorskip("cupy")

from kernels.cuda._build import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kernels.cpu import codecs as ref  # noqa: E402
from kernels.cpu.rotation import rotate  # noqa: E402
from kernels.cuda import codecs as gpu  # noqa: E402


@pytest.fixture(autouse=True)
def ieee_host_floats():
    """The numpy reference must run with IEEE subnormals. A library loaded into the process
    can switch the x86 FTZ/DAZ bits on (then 1e-40 * 2 == 0 on the host); restore the
    default floating-point environment (glibc FE_DFL_ENV) for the reference."""
    if np.float32(1e-40) * np.float32(2.0) == 0:
        ctypes.CDLL(ctypes.util.find_library("m")).fesetenv(ctypes.c_void_p(-1))
    assert np.float32(1e-40) * np.float32(2.0) != 0, "host float32 flushes subnormals"


def hostile_rows(rng, n: int) -> np.ndarray:
    """Random rows over many magnitudes plus every inert / edge case the contract names."""
    R = 3000
    x = rng.standard_normal((R, n)).astype(np.float32)
    x *= np.exp(rng.uniform(-30, 30, (R, 1))).astype(np.float32)   # 1e-13 .. 1e13
    x[:200] *= np.float32(1e-25)                                    # tiny but live rows
    x[200:260] = np.float32(0.0)                                    # zero rows
    x[260:300] = rng.standard_normal((40, n)).astype(np.float32) * np.float32(1e-41)  # subnormal
    x[300:320] = np.nan                                             # all-NaN rows
    x[320:400, ::7] = np.nan                                        # some NaN, row live
    x[400:420, min(3, n - 1)] = np.inf
    x[420:440, min(5, n - 1)] = -np.inf
    x[440:470] = rng.choice([-3e38, 3e38, 1e38], (30, n)).astype(np.float32)  # huge
    x[470:480, :min(n, 11)] = np.float32(1e38)                      # butterfly overflow
    x[480:500] = -0.0
    # fp8 round-half-even ties: amax 448 -> inv 1, values halfway between codes
    ties = np.array([1.0625, 1.1875, 3.25, 0.001953125 * 1.5, 0.001953125 * 2.5, 0.0146484375,
                     -1.0625, 440.0, 432.0, 0.015625 * 1.03125], np.float32)
    x[500:520] = rng.choice(ties, (20, n))
    x[500:520, 0] = np.float32(448.0)
    x[520:540] = rng.integers(-3, 4, (20, n)).astype(np.float32) * np.float32(0.128)
    x[540:560] = np.float32(2.0 ** -126) * rng.integers(1, 9, (20, n)).astype(np.float32)
    return x


@pytest.mark.parametrize("tier", ["kv8", "tq4", "f32"])
@pytest.mark.parametrize("n", [512, 64, 2, 2048])
def test_encode_bytes_equal_numpy(tier, n):
    rng = np.random.default_rng(n * 7 + len(tier))
    x = hostile_rows(rng, n)
    want_c, want_s = ref.encode_rows(tier, x)
    got_c, got_s = gpu.encode_rows(tier, cp.asarray(x))
    got_c, got_s = got_c.get(), got_s.get()
    assert got_c.dtype == want_c.dtype and got_c.shape == want_c.shape
    bad = np.flatnonzero((got_c.view(np.uint8) != want_c.view(np.uint8)).reshape(len(x), -1).any(1))
    assert bad.size == 0, f"{tier} n={n}: {bad.size} rows differ, first {bad[:8]}"
    assert np.array_equal(got_s.view(np.uint32), want_s.view(np.uint32)), f"{tier} scales"


def test_encode_inert_width_and_leading_shape():
    x = np.random.default_rng(1).standard_normal((3, 5, 48)).astype(np.float32)
    c, s = gpu.encode_rows("tq4", cp.asarray(x))  # 48 is not a power of two: inert
    wc, ws = ref.encode_rows("tq4", x)
    assert c.shape == wc.shape == (3, 5, 24) and np.array_equal(c.get(), wc)
    assert np.array_equal(s.get(), ws)


def test_rotate_rows_bit_exact():
    x = np.random.default_rng(2).standard_normal((257, 512)).astype(np.float32)
    got = gpu.rotate_rows(cp.asarray(x)).get()
    assert np.array_equal(got.view(np.uint32), rotate(x).view(np.uint32))


def test_wrapper_rejects_bad_input():
    with pytest.raises(TypeError, match="float32"):
        gpu.encode_rows("kv8", cp.zeros((2, 8), cp.float64))
    with pytest.raises(TypeError, match="cupy"):
        gpu.encode_rows("kv8", np.zeros((2, 8), np.float32))
    with pytest.raises(Exception, match="polar3"):
        gpu.encode_rows("polar3", cp.zeros((2, 8), cp.float32))
