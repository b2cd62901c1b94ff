// GPU row encoders of the kv8 (fp8 e4m3fn) and tq4 tiers. They write exactly the bytes of
// the numpy reference (kernels/cpu/fp8.py, tq4.py, rotation.py; DESIGN.md "KV tiers"):
// every float32 operation whose operands or result can be subnormal is inline PTX without
// .ftz (CuPy appends -ftz=true to every NVRTC compile, which would flush them), in the
// contract's order; the module is compiled with --fmad=false so nothing is fused.
//
// One block per row. Launch: grid = rows, block = THREADS; tq4 needs n floats of dynamic
// shared memory.

#define THREADS 256

// IEEE float32 (round to nearest even, subnormals kept) whatever the -ftz setting.
__device__ __forceinline__ float add_ieee(float a, float b) {
    float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float sub_ieee(float a, float b) {
    float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float mul_ieee(float a, float b) {
    float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ float div_ieee(float a, float b) {
    float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ __forceinline__ double f32_to_f64(float a) {
    double r; asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a)); return r;
}
__device__ __forceinline__ float f64_to_f32(double a) {
    float r; asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(a)); return r;
}
__device__ __forceinline__ float abs_bits(float a) { return __int_as_float(__float_as_int(a) & 0x7FFFFFFF); }
__device__ __forceinline__ float neg_bits(float a) { return __int_as_float(__float_as_int(a) ^ 0x80000000); }

__device__ __forceinline__ float block_max(float v, float* red) {
    // fmaxf returns the other operand when one is NaN, so a NaN never raises the max.
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < THREADS / 32 ? red[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    return red[0];
}

// The contract's enc(): f is x_i * inv, already rounded to float32.
__device__ __forceinline__ unsigned int e4m3_enc(float f) {
    unsigned int sign = (__float_as_uint(f) >> 24) & 0x80u;
    float a = abs_bits(f);
    if (isnan(a)) return 0u;
    if (a > 448.0f) return sign | 0x7Eu;  // also Inf
    if (a < 0.015625f) return sign | (unsigned int)rintf(a * 512.0f);  // exact scaling
    int e;
    frexpf(a, &e);  // a = m * 2^e, m in [0.5, 1)
    int E = e + 6;
    int k = (int)rintf(ldexpf(a, 4 - e));  // in [8, 16], rint is round-half-even
    if (k == 16) { k = 8; E += 1; }
    if (E > 15 || (E == 15 && k > 14)) return sign | 0x7Eu;
    return sign | ((unsigned int)E << 3) | (unsigned int)(k - 8);
}

extern "C" __global__ void __launch_bounds__(THREADS)
fp8_encode(const float* __restrict__ x, unsigned char* __restrict__ codes,
           float* __restrict__ scales, int n) {
    __shared__ float red[THREADS / 32];
    const float* xr = x + (size_t)blockIdx.x * n;
    unsigned char* cr = codes + (size_t)blockIdx.x * n;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < n; i += THREADS) amax = fmaxf(amax, abs_bits(xr[i]));
    amax = block_max(amax, red);
    bool live = (amax > 1e-35f) && !(amax > 3.4e38f);
    float inv = live ? div_ieee(448.0f, amax) : 0.0f;
    for (int i = threadIdx.x; i < n; i += THREADS)
        cr[i] = live ? (unsigned char)e4m3_enc(mul_ieee(xr[i], inv)) : (unsigned char)0;
    if (threadIdx.x == 0) scales[blockIdx.x] = live ? div_ieee(amax, 448.0f) : 1.0f;
}

// ---- rotation (shared with tq4): y = H(D x) --------------------------------------------

#include "sign_hash.cuh"

// In-place radix-2 butterfly on buf[n] in shared memory (stages len = 1, 2, ..., n/2),
// without the 1/sqrt(n) multiply. All threads of the block call it.
__device__ __forceinline__ void butterfly(float* buf, int n) {
    for (int len = 1; len < n; len <<= 1) {
        __syncthreads();
        for (int p = threadIdx.x; p < n / 2; p += THREADS) {
            int j = (p / len) * 2 * len + (p % len);
            float a = buf[j], b = buf[j + len];
            buf[j] = add_ieee(a, b);
            buf[j + len] = sub_ieee(a, b);
        }
    }
    __syncthreads();
}

__constant__ float TQ_LEVELS[16] = {
    -2.733f, -2.069f, -1.618f, -1.256f, -0.942f, -0.657f, -0.388f, -0.128f,
    0.128f, 0.388f, 0.657f, 0.942f, 1.256f, 1.618f, 2.069f, 2.733f};

// Nearest level, the lower index on a tie: the two levels that bracket v decide, as in the
// contract's strict-less scan (kernels/cpu/tq4.py nearest_level); non-finite v -> 0.
__device__ __forceinline__ unsigned int tq_nearest(float v) {
    if (!isfinite(v)) return 0u;
    int lo = 0;
#pragma unroll
    for (int k = 1; k < 15; ++k) lo += (v >= TQ_LEVELS[k]);
    float dlo = abs_bits(sub_ieee(v, TQ_LEVELS[lo]));
    float dhi = abs_bits(sub_ieee(v, TQ_LEVELS[lo + 1]));
    return (unsigned int)(lo + (dhi < dlo));
}

// x[rows, n] -> codes[rows, n/2], radius[rows]. n is a power of two in 2..2048 (the
// wrapper makes other widths inert without a launch). sqrt_n = sqrtf(n) and
// inv_sqrt_n = 1.0f / sqrtf(n), both float32 as the reference computes them.
extern "C" __global__ void __launch_bounds__(THREADS)
tq4_encode(const float* __restrict__ x, unsigned char* __restrict__ codes,
           float* __restrict__ radius, int n, float sqrt_n, float inv_sqrt_n) {
    extern __shared__ float buf[];
    __shared__ float s_norm;
    const float* xr = x + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += THREADS) {
        float v = xr[i];
        buf[i] = neg_sign((unsigned int)i) ? neg_bits(v) : v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // float64 sum of squares from index 0 upward: the reference's order, so the same
        // double rounding (squares of floats are exact in double); |D x| = |x|.
        double ss = 0.0;
        for (int i = 0; i < n; ++i) {
            double v = f32_to_f64(buf[i]);
            ss = __dadd_rn(ss, __dmul_rn(v, v));
        }
        s_norm = f64_to_f32(__dsqrt_rn(ss));
    }
    butterfly(buf, n);  // begins with a barrier, so s_norm is visible after it
    float norm = s_norm;
    bool live = (norm > 1e-35f) && !(norm > 3.4e38f);
    float invstd = live ? div_ieee(sqrt_n, norm) : 0.0f;
    unsigned char* cr = codes + (size_t)blockIdx.x * (n / 2);
    for (int i = threadIdx.x; i < n / 2; i += THREADS) {
        unsigned int c0 = tq_nearest(mul_ieee(mul_ieee(buf[2 * i], inv_sqrt_n), invstd));
        unsigned int c1 = tq_nearest(mul_ieee(mul_ieee(buf[2 * i + 1], inv_sqrt_n), invstd));
        cr[i] = live ? (unsigned char)(c0 | (c1 << 4)) : (unsigned char)0;
    }
    if (threadIdx.x == 0) radius[blockIdx.x] = live ? norm : 0.0f;
}

// y = H(D x) of float32 rows (queries of the tq tiers): the reference's rotate().
// x[rows, n] -> y[rows, n]; same launch shape as tq4_encode.
extern "C" __global__ void __launch_bounds__(THREADS)
rotate_rows(const float* __restrict__ x, float* __restrict__ y, int n, float inv_sqrt_n) {
    extern __shared__ float buf[];
    const float* xr = x + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += THREADS) {
        float v = xr[i];
        buf[i] = neg_sign((unsigned int)i) ? neg_bits(v) : v;
    }
    butterfly(buf, n);
    float* yr = y + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += THREADS) yr[i] = mul_ieee(buf[i], inv_sqrt_n);
}
