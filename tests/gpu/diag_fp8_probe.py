"""Diagnostic (not a test): e4m3 wgmma over attn_wg's shared-memory layouts, against numpy.

    python3 tests/gpu/diag_fp8_probe.py

One warpgroup scores 64 kv8 key rows (512 latent e4m3 codes, 128-byte swizzled K-major
atoms of 64 rows per 128-byte column block, the layout the TMA writes) against 64 heads of a
query split into two e4m3 terms (q1 = e4m3(x), q2 = e4m3(x - q1), x scaled to max 448; same
layout), by m64n32k32 e4m3 wgmma from shared memory (A and B by descriptor), two chains of
32 heads into one accumulator each. Printed: the relative error of the scores against float64
over the two terms exactly (the tensor cores' own accumulation) and against the exact query
(what the kernel would see), for the terms into one accumulator and into two.
"""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.cpu import codecs  # noqa: E402
from scripts.fp8_query_precision import E4M3, e4m3  # noqa: E402

SRC = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ u64 desc128(u32 saddr) {  // K-major, 128-byte swizzle, SBO 1024
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void mma32(float* d, u64 da, u64 db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "%16, %17, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db), "r"(acc));
}
// swizzled offset of byte c of row r in [cb][64 rows][128 B] atoms
__device__ __forceinline__ int sw(int r, int c) {
    return (c >> 7) * 8192 + r * 128 + ((((c & 127) >> 4) ^ (r & 7)) << 4) + (c & 15);
}
template <int mode>
__device__ __forceinline__ void probe_body(const unsigned char* K, const unsigned char* Q, float* out) {
    extern __shared__ __align__(1024) unsigned char sm[];
    unsigned char* sk = sm;             // 32 KB
    unsigned char* sq = sm + 32768;     // 2 terms x 32 KB
    const int tid = threadIdx.x;
    for (int i = tid; i < 64 * 512; i += 128) {
        const int r = i / 512, c = i % 512;
        sk[sw(r, c)] = K[i];
        sq[sw(r, c)] = Q[i];
        sq[32768 + sw(r, c)] = Q[32768 + i];
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    float a[2][16], b[2][16];
    for (int i = 0; i < 16; ++i) { a[0][i] = a[1][i] = b[0][i] = b[1][i] = 0.0f; }
    const u32 kb = smem_u32(sk), qb = smem_u32(sq);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
        const u32 ko = (kk >> 2) * 8192 + (kk & 3) * 32;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
                mma32(mode == 1 && t == 1 ? (hf ? b[1] : a[1]) : (hf ? b[0] : a[0]), desc128(kb + ko), desc128(qb + t * 32768 + ko + hf * 4096), 1);
        }
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    for (int hf = 0; hf < 2; ++hf)
        for (int j = 0; j < 4; ++j)
            for (int e = 0; e < 4; ++e) {
                const int row = 16 * warp + g + 8 * (e >> 1), col = 32 * hf + 8 * j + 2 * q + (e & 1);
                const float v = hf ? b[0][4 * j + e] + b[1][4 * j + e] : a[0][4 * j + e] + a[1][4 * j + e];
                out[row * 64 + col] = v;
            }
}
// mode 0: both terms into one accumulator; 1: each term into its own, summed in f32
extern "C" __global__ void __launch_bounds__(128) probe0(const unsigned char* K, const unsigned char* Q, float* out) {
    probe_body<0>(K, Q, out);
}
extern "C" __global__ void __launch_bounds__(128) probe1(const unsigned char* K, const unsigned char* Q, float* out) {
    probe_body<1>(K, Q, out);
}
"""


def main() -> None:
    rng = np.random.default_rng(7)
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90a", "-std=c++17"))
    fns = [mod.get_function(f"probe{m}") for m in (0, 1)]
    for fn in fns:
        fn.max_dynamic_shared_size_bytes = 98304
    for trial in range(3):
        # kv8 rows as the pool holds them (the codes alone: the per-token scale stays out)
        kf = rng.standard_normal((64, 512)) * np.exp(rng.uniform(-1, 1, (64, 1)))
        kc = codecs.encode_rows("kv8", kf)[0].reshape(64, 512)
        kd = kc.view(E4M3).astype(np.float64)
        # the query split as scripts/fp8_query_precision.py's "e4m3 x2"
        q = rng.standard_normal((64, 512)) * (1.0 + (np.arange(512) < 32) * 3.0)
        x = q / np.abs(q).max(axis=1, keepdims=True) * 448.0
        q1 = e4m3(x)
        q2 = e4m3(x - q1)
        qt = q1 + q2
        K = cp.asarray(kc)
        Q = cp.asarray(np.concatenate([q1, q2]).astype(np.float32).astype(E4M3).view(np.uint8))
        s_terms = kd @ qt.T
        s_exact = kd @ x.T
        rms = np.sqrt(np.mean(s_exact ** 2))
        for mode in (0, 1):
            out = cp.zeros((64, 64), dtype=cp.float32)
            fns[mode]((1,), (128,), (K, Q, out), shared_mem=98304)
            s = cp.asnumpy(out).astype(np.float64)
            e_t = np.abs(s - s_terms) / rms
            e_x = np.abs(s - s_exact) / rms
            print(f"trial {trial} mode {mode} ({'one accumulator' if mode == 0 else 'a term each'}): "
                  f"vs the two terms max {e_t.max():.2e} mean {e_t.mean():.2e}; "
                  f"vs the exact query max {e_x.max():.2e} mean {e_x.mean():.2e}; "
                  f"terms alone vs exact mean {(np.abs(s_terms - s_exact) / rms).mean():.2e}")


if __name__ == "__main__":
    main()
