"""MLX codecs vs the numpy reference: codes and scales bit for bit, on random and hostile rows."""
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
# the numpy reference warns about the hostile values (overflowing norms, Inf - level); intended
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value):RuntimeWarning")

from kernels.cpu import codecs as cpu_codecs  # noqa: E402
from kernels.cpu import fp8 as cpu_fp8  # noqa: E402
from kernels.cpu import rotation as cpu_rot  # noqa: E402
from kernels.cpu import tq4 as cpu_tq4  # noqa: E402
from kernels.metal import codecs, fp8, rotation, tq4  # noqa: E402
from kernels.metal.backend import KernelStats  # noqa: E402
from kernels.tiers import TierError  # noqa: E402


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def hostile_rows(rng, rows: int, n: int) -> np.ndarray:
    """Gaussian rows at magnitudes from 1e-30 to 1e30, plus every inert/special kind."""
    x = rng.standard_normal((rows, n)) * np.exp(rng.uniform(-69, 69, (rows, 1)))
    x = x.astype(np.float32)
    x[0] = 0.0                                       # zero row
    x[1] = np.nan                                    # all-NaN row
    x[2, n // 2] = np.inf                            # Inf in a row
    x[3] = np.float32(1e-40) * rng.standard_normal(n).astype(np.float32)  # subnormal row
    x[4, ::3] = np.nan                               # NaN among normal values
    x[5] = -0.0
    x[6] = np.float32(3.0e38)                        # near float32 max (norm overflows)
    x[7, 0] = -np.inf
    x[8] = rng.standard_normal(n).astype(np.float32)
    x[8, 1] = np.float32(1e-39)                      # one subnormal among normal values
    x[9] = np.float32(1e-36)                         # tiny but normal: amax under 1e-35
    return x


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
@pytest.mark.parametrize("n", [512, 64, 16, 2])
def test_encode_bit_identical_random_and_hostile(tier, n):
    rng = np.random.default_rng(n)
    x = hostile_rows(rng, 257, n)
    c_ref, s_ref = cpu_codecs.encode_rows(tier, x.copy())  # copy: the reference wrote into a
    # single-row block's input at one point (np.ascontiguousarray(x.T) shares memory)
    c, s = codecs.encode_rows(tier, mx.array(x))
    np.testing.assert_array_equal(bits(np.array(c)), bits(c_ref))
    np.testing.assert_array_equal(bits(np.array(s)), bits(s_ref))
    assert np.array(c).dtype == c_ref.dtype and np.array(s).dtype == np.float32


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
def test_leading_axes_and_decode_match(tier):
    rng = np.random.default_rng(7)
    x = hostile_rows(rng, 60, 128).reshape(3, 20, 128)
    c_ref, s_ref = cpu_codecs.encode_rows(tier, x.copy())
    c, s = codecs.encode_rows(tier, mx.array(x))
    assert tuple(c.shape) == c_ref.shape and tuple(s.shape) == s_ref.shape
    d_ref = cpu_codecs.decode_rows(tier, c_ref, s_ref, 128)
    d = codecs.decode_rows(tier, c, s, 128)
    np.testing.assert_array_equal(bits(np.array(d)), bits(d_ref))


def test_fp8_enc_on_random_bit_patterns_and_ties():
    rng = np.random.default_rng(3)
    u = rng.integers(0, 2 ** 32, 400_000, dtype=np.uint64).astype(np.uint32)
    # RNE ties: midpoints between neighbouring e4m3 values, normal and subnormal, both signs
    vals = np.unique(np.abs(cpu_fp8.DECODE_TABLE[:0x7F]))
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    edge = np.array([448, 464, 480, 2 ** -6, 2 ** -7, 2 ** -9, 2 ** -10, 2 ** -10 * 3,
                     np.inf, np.nan, 0.0], np.float32)
    f = np.concatenate([u.view(np.float32), mids, -mids, edge, -edge,
                        np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9))])
    np.testing.assert_array_equal(np.array(fp8.enc(mx.array(f))), cpu_fp8.enc(f))
    np.testing.assert_array_equal(cpu_fp8.enc(f[-200:]), cpu_fp8.enc_reference(f[-200:]))


def test_fp8_saturation_at_the_row_max():
    # amax * (448 / amax) rounds above 448 for some amax: those bytes must saturate to 0x7E
    rng = np.random.default_rng(11)
    amax = rng.uniform(1, 2, 5000).astype(np.float32)
    x = np.stack([amax, -amax, amax / 3], axis=1)
    c_ref, _ = cpu_codecs.encode_rows("kv8", x)
    c, _ = codecs.encode_rows("kv8", mx.array(x))
    assert (c_ref[:, 0] == 0x7E).any()  # the case occurs in this sample
    np.testing.assert_array_equal(np.array(c), c_ref)


def test_tq4_nearest_level_ties_and_specials():
    lv = cpu_tq4.LEVELS.astype(np.float64)
    mids = ((lv[:-1] + lv[1:]) / 2).astype(np.float32)
    v = np.concatenate([mids, np.nextafter(mids, np.float32(-9)), np.nextafter(mids, np.float32(9)),
                        cpu_tq4.LEVELS, [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30]]
                       ).astype(np.float32)
    t = np.array(tq4._THRESHOLDS + [tq4._TIE_ABOVE], np.float32)  # every decision edge
    big = np.concatenate([np.arange(2 ** 23 - 64, 2 ** 23 + 64, 0.25, dtype=np.float32),
                          np.arange(2 ** 24 - 64, 2 ** 24 + 4096, 1, dtype=np.float32)])
    v = np.concatenate([v, t, np.nextafter(t, np.float32(-np.inf)), np.nextafter(t, np.float32(np.inf)),
                        big, -big, np.float32(2.0) ** np.arange(-149, 128, dtype=np.float32)])
    v = np.concatenate([v, np.random.default_rng(5).standard_normal(10000).astype(np.float32) * 2])
    got = np.array(tq4.nearest_level(mx.array(v)))
    np.testing.assert_array_equal(got, cpu_tq4.nearest_level(v))


def test_tq4_norm_is_the_sequential_float64_sum():
    # order matters: 2^54 then ones -- a sequential float64 sum never moves, a pairwise one does
    x = np.ones((4, 1024), np.float32)
    x[:, 0] = np.float32(2.0 ** 27)
    sq = x.astype(np.float64) ** 2
    seq = np.add.accumulate(sq, axis=-1)[:, -1]
    assert sq.sum(axis=-1)[0] != seq[0]  # the orders really differ here
    x64 = mx.array(x).astype(mx.float64, stream=mx.cpu)
    acc = mx.cumsum(x64 * x64, axis=-1, stream=mx.cpu)[:, -1]
    np.testing.assert_array_equal(np.array(acc), seq)
    rng = np.random.default_rng(9)
    y = hostile_rows(rng, 512, 2048)
    np.testing.assert_array_equal(bits(np.array(tq4.row_norms(mx.array(y)))),
                                  bits(cpu_tq4.row_norms(y)))


@pytest.mark.parametrize("n", [2, 8, 64, 512, 2048])
def test_rotation_bit_identical(n):
    x = np.random.default_rng(n).standard_normal((33, n)).astype(np.float32) * 1e3
    np.testing.assert_array_equal(bits(np.array(rotation.rotate(mx.array(x)))),
                                  bits(cpu_rot.rotate(x)))
    np.testing.assert_array_equal(bits(np.array(rotation.unrotate(mx.array(x)))),
                                  bits(cpu_rot.unrotate(x)))
    np.testing.assert_array_equal(bits(np.array(rotation.butterfly(mx.array(x)))),
                                  bits(cpu_rot.hadamard(x)))
    with pytest.raises(ValueError, match="n=12"):
        rotation.rotate(mx.zeros((1, 12)))


def test_tq4_encode_exact_on_the_butterfly_path_too(monkeypatch):
    """Where MLX's Walsh-Hadamard kernel does not match (it may not on Metal) the butterfly
    serves: the codes must be the same either way."""
    monkeypatch.setattr(rotation, "_native_is_exact", lambda n, device: False)
    x = hostile_rows(np.random.default_rng(17), 64, 256)
    c_ref, s_ref = cpu_codecs.encode_rows("tq4", x.copy())
    c, s = codecs.encode_rows("tq4", mx.array(x))
    np.testing.assert_array_equal(np.array(c), c_ref)
    np.testing.assert_array_equal(bits(np.array(s)), bits(s_ref))


def test_polar_goes_through_numpy_and_is_counted():
    stats = KernelStats()
    x = np.random.default_rng(2).standard_normal((9, 64)).astype(np.float32)
    c, s = codecs.encode_rows("polar3", mx.array(x), stats=stats)
    c_ref, s_ref = cpu_codecs.encode_rows("polar3", x)
    np.testing.assert_array_equal(np.array(c), c_ref)
    assert stats.fallback["encode_polar3"] == 1 and stats.fallback_count() == 1


def test_bad_width_names_the_shape():
    with pytest.raises(ValueError, match="n=7"):
        codecs.encode_rows("tq4", mx.zeros((2, 7)))


def test_fused_kernels_match_numpy():
    """The mx.compile'd forms used on the GPU, run here on the CPU backend (the first run on
    a machine builds them with the C++ compiler: several seconds)."""
    rng = np.random.default_rng(23)
    f = np.concatenate([rng.integers(0, 2 ** 32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        (rng.standard_normal(50_000) * 3).astype(np.float32)])
    mf = mx.array(f)
    np.testing.assert_array_equal(np.array(fp8._enc_fused(mf.view(mx.uint32), mf)), cpu_fp8.enc(f))
    np.testing.assert_array_equal(np.array(tq4._nearest_fused(mf, mf.view(mx.uint32))),
                                  cpu_tq4.nearest_level(f))


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4", "polar3"])
def test_zero_rows_encode_and_decode_like_numpy(tier):
    """A batch of no rows (an empty write) gives empty codes, as numpy does; MLX's
    hadamard_transform refuses empty arrays, which crashed the tq4 codec."""
    from kernels.metal import rotation
    x = np.zeros((0, 64), np.float32)
    c_ref, s_ref = cpu_codecs.encode_rows(tier, x)
    c, s = codecs.encode_rows(tier, mx.array(x))
    assert tuple(c.shape) == c_ref.shape and tuple(s.shape) == s_ref.shape
    d = codecs.decode_rows(tier, c_ref, s_ref, 64)
    assert tuple(d.shape) == (0, 64)
    for fn in (rotation.rotate, rotation.unrotate, rotation.rotate_fast, rotation.unrotate_fast):
        assert tuple(fn(mx.zeros((0, 3, 64))).shape) == (0, 3, 64)


def test_mlx_pool_takes_an_empty_write():
    from kernels.metal.pool import MLXKVPool
    pool = MLXKVPool(1, 64, 16, "tq4", n_blocks=4, block_size=4, max_slots=1)
    s = pool.alloc_slot()
    pool.write(0, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 64), np.float32),
               np.zeros((0, 16), np.float32))
    assert pool.length(s) == 0


def test_fp8_signalling_nan_does_not_raise_amax():
    """A NaN never raises amax, whatever its payload: numpy's fmax.reduce returned a
    signalling NaN (quiet bit clear) at some positions, so the numpy reference stored the
    row as inert where MLX, CUDA and the C transcription keep it live."""
    nans = np.array([0x7F800001, 0xFF800001, 0x7FA00000, 0x7FC00000, 0xFFFFFFFF],
                    np.uint32).view(np.float32)
    rows = []
    for nan in nans:
        for pos in range(4):
            r = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
            r[pos] = nan
            rows.append(r)
    x = np.repeat(np.stack(rows), 3, axis=0)
    c_ref, s_ref = cpu_codecs.encode_rows("kv8", x)
    c, s = codecs.encode_rows("kv8", mx.array(x))
    amax = np.array([np.abs(r[~np.isnan(r)]).max() for r in x], np.float32)
    np.testing.assert_array_equal(s_ref, amax / np.float32(448))  # the contract's scale
    np.testing.assert_array_equal(np.array(c), c_ref)
    np.testing.assert_array_equal(bits(np.array(s)), bits(s_ref))


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
def test_decode_takes_codes_in_any_integer_dtype_like_numpy(tier):
    """Codes in any integer dtype decode as numpy's reference does: values 0..255 as the
    bytes they are, wider ones as the same TierError (the MLX decode gathered its tables
    through the codes as given, so int codes of 300 or 2^20 read past them: a segfault)."""
    codes = np.array([[1, 3, 200, 255, 7, 0x7F, 0x80, 9]], np.int64)
    scales = np.array([0.5], np.float32)
    n = 8 if tier == "kv8" else 16  # 8 code bytes either way
    want = cpu_codecs.decode_rows(tier, codes, scales, n)
    for c in (codes, codes.tolist(), mx.array(codes.astype(np.int32))):
        np.testing.assert_array_equal(bits(np.array(codecs.decode_rows(tier, c, scales, n))),
                                      bits(want))
    wide = codes.copy()
    wide[0, 1], wide[0, 2] = 300, 2 ** 20
    for c in (wide, wide.tolist(), mx.array(wide.astype(np.int32))):
        with pytest.raises(TierError, match=r"in 1\.\.1048576"):
            codecs.decode_rows(tier, c, scales, n)
    with pytest.raises(TierError, match=r"in 1\.\.1048576"):
        cpu_codecs.decode_rows(tier, wide, scales, n)


@pytest.mark.parametrize("n", [2, 64, 512])
def test_tq4_decode_of_huge_radii_matches_numpy(n):
    """Radii from 2^64 up to float32 max (a hostile file's) decode through the same exact
    power-of-two rescale as the numpy reference: the same bits, no NaN from the butterfly."""
    rng = np.random.default_rng(n + 5)
    codes = rng.integers(0, 256, (400, n // 2)).astype(np.uint8)
    radius = (2.0 ** rng.uniform(-116, 128, 400)).astype(np.float32)
    radius[:3] = [np.finfo(np.float32).max, 3.4e38, 2.0 ** 64]
    want = cpu_codecs.decode_rows("tq4", codes, radius, n)
    assert not np.isnan(want).any()
    got = codecs.decode_rows("tq4", mx.array(codes), mx.array(radius), n)
    np.testing.assert_array_equal(bits(np.array(got)), bits(want))
