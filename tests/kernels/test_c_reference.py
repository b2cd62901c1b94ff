"""The numpy codecs against a C transcription of DESIGN.md "KV tiers" (float, libm), bit for bit.

The C below is written from the contract text, loop by loop, the way a C engine would
(scalar float arithmetic, a double accumulator for the norm, atan2f/hypotf from libm). It
is compiled with -ffp-contract=off so no multiply-add is fused. fp8, the rotation and tq4
must match exactly; polar codes may differ where libm's atan2f/hypotf and numpy's float32
arctan2/hypot round the last bit differently and an angle sits on a bin boundary (the
contract allows such flips), so polar counts them and bounds the rate.
"""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from kernels.cpu import fp8, polar, rotation, tq4
from kernels.tiers import get_tier

C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static const float LEVELS[16] = {-2.733f, -2.069f, -1.618f, -1.256f, -0.942f, -0.657f,
    -0.388f, -0.128f, 0.128f, 0.388f, 0.657f, 0.942f, 1.256f, 1.618f, 2.069f, 2.733f};
static const float PI = 3.14159265358979f;

static uint8_t enc(float f) {
    uint8_t s = signbit(f) ? 0x80 : 0;
    float a = fabsf(f);
    if (isnan(f)) return 0;
    if (a > 448.f || isinf(a)) return s | 0x7E;
    if (a < 0x1p-6f) return s | (uint8_t)rintf(a * 512.f);
    int e; frexpf(a, &e);
    int E = e + 6, k = (int)rintf(ldexpf(a, 4 - e));
    if (k == 16) { k = 8; E++; }
    if (E > 15 || (E == 15 && k > 14)) return s | 0x7E;
    return s | (uint8_t)(E << 3) | (uint8_t)(k - 8);
}

void fp8_encode(const float *x, int rows, int n, uint8_t *codes, float *scales) {
    for (int r = 0; r < rows; r++) {
        const float *v = x + (long)r * n;
        float amax = 0.f;
        for (int i = 0; i < n; i++) { float a = fabsf(v[i]); if (a > amax) amax = a; }
        if (!(amax > 1e-35f) || amax > 3.4e38f) {
            memset(codes + (long)r * n, 0, n); scales[r] = 1.f; continue;
        }
        float inv = 448.f / amax;
        for (int i = 0; i < n; i++) codes[(long)r * n + i] = enc(v[i] * inv);
        scales[r] = amax / 448.f;
    }
}

static uint32_t mix(uint32_t x) {
    x += 0x9E3779B9u;
    x = (x ^ (x >> 16)) * 0x85EBCA6Bu;
    x = (x ^ (x >> 13)) * 0xC2B2AE35u;
    return x ^ (x >> 16);
}

static void hadamard(float *a, int n) {
    for (int len = 1; len < n; len <<= 1)
        for (int i = 0; i < n; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                float u = a[j], w = a[j + len];
                a[j] = u + w; a[j + len] = u - w;
            }
    float s = 1.f / sqrtf((float)n);
    for (int i = 0; i < n; i++) a[i] *= s;
}

void rotate(float *a, int n) {
    for (int i = 0; i < n; i++) if (mix(0x9E3779B9u ^ (uint32_t)i) & 1) a[i] = -a[i];
    hadamard(a, n);
}

void unrotate(float *a, int n) {
    hadamard(a, n);
    for (int i = 0; i < n; i++) if (mix(0x9E3779B9u ^ (uint32_t)i) & 1) a[i] = -a[i];
}

static float row_norm(const float *v, int n) {
    double acc = 0.0;
    for (int i = 0; i < n; i++) acc += (double)v[i] * (double)v[i];
    return (float)sqrt(acc);
}

void tq4_encode(const float *x, int rows, int n, uint8_t *codes, float *radius, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *v = x + (long)r * n;
        uint8_t *c = codes + (long)r * n / 2;
        memset(c, 0, n / 2);
        float norm = row_norm(v, n);
        if (!(norm > 1e-35f) || norm > 3.4e38f) { radius[r] = 0.f; continue; }
        memcpy(y, v, n * sizeof(float));
        rotate(y, n);
        float invstd = sqrtf((float)n) / norm;
        for (int i = 0; i < n; i++) {
            float t = y[i] * invstd;
            int best = 0; float bd = fabsf(t - LEVELS[0]);
            for (int k = 1; k < 16; k++) { float d = fabsf(t - LEVELS[k]); if (d < bd) { bd = d; best = k; } }
            c[i / 2] |= (uint8_t)(best << (4 * (i & 1)));
        }
        radius[r] = norm;
    }
}

void tq4_decode(const uint8_t *codes, const float *radius, int rows, int n, float *out) {
    for (int r = 0; r < rows; r++) {
        float *o = out + (long)r * n;
        float rad = radius[r];
        if (!(rad > 0.f) || !isfinite(rad)) { memset(o, 0, n * sizeof(float)); continue; }
        float step = rad / sqrtf((float)n);
        for (int i = 0; i < n; i++) {
            int k = (codes[(long)r * n / 2 + i / 2] >> (4 * (i & 1))) & 15;
            o[i] = LEVELS[k] * step;
        }
        unrotate(o, n);
    }
}

void polar_encode(const float *x, int rows, int n, int B, int nbytes, uint8_t *codes,
                  float *radius, float *y) {
    for (int r = 0; r < rows; r++) {
        const float *v = x + (long)r * n;
        uint8_t *c = codes + (long)r * nbytes;
        memset(c, 0, nbytes);
        float norm = row_norm(v, n);
        if (!(norm > 1e-35f) || norm > 3.4e38f) { radius[r] = 0.f; continue; }
        memcpy(y, v, n * sizeof(float));
        rotate(y, n);
        long cursor = 0;
        int level = 1;
        for (int count = n / 2; count >= 1; count /= 2, level++) {
            int b = level == 1 ? B : (B - 1 > 1 ? B - 1 : 1);
            int top = (1 << b) - 1;
            for (int j = 0; j < count; j++) {
                float a0 = y[2 * j], a1 = y[2 * j + 1];
                float ang = atan2f(a1, a0);
                y[j] = hypotf(a0, a1);
                float t;
                if (level == 1) {
                    t = (ang + PI) * (0.5f / PI) * (float)(1 << b);
                } else {
                    float w = fminf(1.5f / sqrtf((float)(1 << (level - 1))), PI / 4.f);
                    t = (ang - (PI / 4.f - w)) / (2.f * w) * (float)(1 << b);
                }
                int q = (int)floorf(t);
                q = q < 0 ? 0 : (q > top ? top : q);
                for (int k = 0; k < b; k++, cursor++)
                    if ((q >> k) & 1) c[cursor / 8] |= (uint8_t)(1 << (cursor % 8));
            }
        }
        radius[r] = norm;
    }
}
"""


@pytest.fixture(scope="module")
def clib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("cref")
    (d / "ref.c").write_text(C_SOURCE)
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
                    "-o", str(d / "ref.so"), str(d / "ref.c"), "-lm"], check=True)
    return ctypes.CDLL(str(d / "ref.so"))


def ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def hostile_rows(rows, n, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * np.exp(rng.uniform(-12, 12, (rows, 1)))).astype(np.float32)
    x[0] = 0
    x[1, min(3, n - 1)] = np.nan
    x[2, 1] = np.inf
    x[3] = np.float32(1e-40)
    x[4, ::3] *= np.float32(1e6)  # a wide dynamic range inside one row
    x[5] = 0
    x[5, n // 2] = 7.0  # one-hot
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("n", [64, 512])
def test_fp8_bit_exact(clib, n):
    x = hostile_rows(200, n, seed=n)
    codes, scales = np.zeros((200, n), np.uint8), np.zeros(200, np.float32)
    clib.fp8_encode(ptr(x), 200, n, ptr(codes), ptr(scales))
    got_c, got_s = fp8.encode(x)
    assert np.array_equal(got_c, codes) and np.array_equal(got_s, scales)


@pytest.mark.parametrize("n", [2, 8, 128, 2048])
def test_rotation_bit_exact(clib, n):
    x = hostile_rows(20, n, seed=n)[6:]
    for r in range(x.shape[0]):
        a = x[r].copy()
        clib.rotate(ptr(a), n)
        assert np.array_equal(rotation.rotate(x[r:r + 1])[0], a)
        clib.unrotate(ptr(a), n)
        assert np.array_equal(rotation.unrotate(rotation.rotate(x[r:r + 1]))[0], a)


@pytest.mark.parametrize("n", [16, 64, 512])
def test_tq4_bit_exact(clib, n):
    rows = 300
    x = hostile_rows(rows, n, seed=3 * n)
    codes, radius = np.zeros((rows, n // 2), np.uint8), np.zeros(rows, np.float32)
    clib.tq4_encode(ptr(x), rows, n, ptr(codes), ptr(radius), ptr(np.zeros(n, np.float32)))
    got_c, got_r = tq4.encode(x)
    assert np.array_equal(got_c, codes) and np.array_equal(got_r, radius)
    out = np.zeros((rows, n), np.float32)
    clib.tq4_decode(ptr(codes), ptr(radius), rows, n, ptr(out))
    assert np.array_equal(tq4.decode(codes, radius, n), out)


@pytest.mark.parametrize("B", [2, 3, 4, 5, 6])
def test_polar_codes_up_to_libm_boundary_flips(clib, B):
    n, rows = 256, 200
    nbytes = get_tier(f"polar{B}").row_bytes(n)
    x = hostile_rows(rows, n, seed=B)
    codes, radius = np.zeros((rows, nbytes), np.uint8), np.zeros(rows, np.float32)
    clib.polar_encode(ptr(x), rows, n, B, nbytes, ptr(codes), ptr(radius),
                      ptr(np.zeros(n, np.float32)))
    got_c, got_r = polar.encode(x, B)
    assert np.array_equal(got_r, radius)
    differ = np.unpackbits(got_c ^ codes).sum()  # stream bits that differ
    assert differ <= 0.002 * polar.stream_bits(n, B) * rows, differ
