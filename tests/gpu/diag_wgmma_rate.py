"""Diagnostic (not a test): the tensor-core rate that one shape of wgmma can reach, so that
the attention kernel's time can be set against what its instruction shape allows.

    python3 tests/gpu/diag_wgmma_rate.py

Every multiprocessor runs one CTA of NWG warpgroups; each warpgroup issues a chain of
m64nNk16 f16 wgmma (A from registers "rs" or shared memory "ss", B from shared memory,
f32 accumulators) into NCH accumulators in turn, GROUP instructions per commit group with
one group left in flight, as attn_wg does; A either constant, or loaded from shared memory
for every wgmma (raw f16, or e4m3 converted in registers: attn_wg's S^T). Operands are random
halves (tensor-core power
depends on the data). Printed: TFLOP/s of each configuration and its ratio to cuBLAS f16
(cupy.matmul 8192^3) measured in the same run.
"""
import sys

import cupy as cp
import numpy as np

from cluster.bench.attention import _cuda_time


def _wgmma_fn(n: int, ss: bool) -> str:
    nd = n // 2
    d = ", ".join(f"%{i}" for i in range(nd))
    if ss:
        a_ops, ai = "%{0}".format(nd), nd + 1
        a_in = '"l"(da)'
    else:
        a_ops, ai = "{" + ", ".join(f"%{nd + i}" for i in range(4)) + "}", nd + 4
        a_in = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])'
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    tail = "p, 1, 1, 0, 0" if ss else "p, 1, 1, 0"
    return f"""
__device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned long long da,
                                    unsigned long long db, int acc) {{
    (void)a; (void)da;
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{ai + 1}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{d}}}, {a_ops}, %{ai}, {tail};\\n}}\\n"
                 : {outs}
                 : {a_in}, "l"(db), "r"(acc));
}}
"""


_E4M3X4 = r"""
__device__ __forceinline__ void ldsm4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                      unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void e4m3x4(unsigned w, unsigned& lo, unsigned& hi) {
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi) : "r"(w));
}
"""


def source(n: int, nwg: int, nch: int, group: int, ss: bool, feed: int = 0) -> str:
    """feed (rs only): 0 constant A registers; 1 A loaded from shared memory for every
    wgmma (one group ahead, as attn_wg's S^T); 2 loaded as e4m3 bytes and converted to f16
    in registers (two words -> four half2 per wgmma, as kv8); 3 as 2, the words of two
    k-steps loaded by one ldmatrix.x4 instead of four 32-bit loads."""
    return _wgmma_fn(n, ss) + _E4M3X4 + f"""
#define FEED {feed}
#define N {n}
#define NWG {nwg}
#define NCH {nch}
#define GROUP {group}
#define TILES 4
typedef unsigned long long u64;
__device__ __forceinline__ u64 desc(unsigned saddr, unsigned lbo, unsigned sbo) {{
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) |
           ((u64)((sbo >> 4) & 0x3FFF) << 32);
}}
template <int cur>
__device__ __forceinline__ void body(int it, unsigned (&raw)[2][GROUP][4], float (&d)[NCH][N / 2],
                                 const unsigned* a, const unsigned* wsrc, unsigned lsrc, u64 da,
                                 u64 db) {{
    constexpr int nxt = 1 - cur;
    (void)raw; (void)wsrc; (void)a; (void)nxt; (void)lsrc;
    unsigned af[GROUP][4];
#pragma unroll
    for (int u = 0; u < GROUP; ++u) {{
#if FEED == 1
#pragma unroll
        for (int i = 0; i < 4; ++i) af[u][i] = raw[cur][u][i] & 0xBBFFBBFFu;  // finite
#elif FEED >= 2
        e4m3x4(raw[cur][u][0] & 0x77777777u, af[u][0], af[u][2]);
        e4m3x4(raw[cur][u][1] & 0x77777777u, af[u][1], af[u][3]);
#else
#pragma unroll
        for (int i = 0; i < 4; ++i) af[u][i] = a[i];
#endif
    }}
#if FEED == 3
    {{
        const int nx = ((it + 1) * GROUP) % 16;
#pragma unroll
        for (int u = 0; u < GROUP; u += 2)
            ldsm4(lsrc + (((nx + u) % 16) / 2) * 4 * 512, raw[nxt][u][0], raw[nxt][u][1],
                  raw[nxt][u + 1][0], raw[nxt][u + 1][1]);
    }}
#elif FEED
    {{
        const int nx = ((it + 1) * GROUP) % 16;
#pragma unroll
        for (int u = 0; u < GROUP; ++u)
#pragma unroll
            for (int i = 0; i < (FEED == 1 ? 4 : 2); ++i)
                raw[nxt][u][i] = wsrc[(((nx + u) % 16) * 4 + i) * 128];
    }}
#endif
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int u = 0; u < GROUP; ++u) {{
        const int t = (it * GROUP + u) % TILES;
        mma(d[u % NCH], af[u], da + (u64)(t * 64 * 32 / 16), db + (u64)(t * N * 32 / 16), 1);
    }}
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
}}

extern "C" __global__ void __launch_bounds__(NWG * 128, 1) rate(float* out, int iters) {{
    extern __shared__ __align__(1024) unsigned char smem[];
    // B: TILES k-steps of N x 16 halves (canonical K-major: 8-row x 16-byte core matrices);
    // A (ss): TILES k-steps of 64 x 16 halves after them.
    const int bbytes = TILES * N * 32, abytes = TILES * 64 * 32;
    const int fill = bbytes + abytes > 16 * 4 * 128 * 4 ? bbytes + abytes : 16 * 4 * 128 * 4;
    unsigned* w = (unsigned*)smem;
    for (int i = threadIdx.x; i < fill / 4; i += blockDim.x) {{
        unsigned x = (unsigned)i * 2654435761u + 12345u * blockIdx.x;
        x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
        w[i] = (x & 0x33FF33FFu) | 0x34003400u;  // halves in [0.25, 2): finite sums
    }}
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    unsigned sa;
    asm("{{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }}" : "=r"(sa) : "l"(smem));
    const u64 db = desc(sa, (N / 8) * 128, 128);
    const u64 da = desc(sa + bbytes, 8 * 128, 128);
    unsigned a[4];
    for (int i = 0; i < 4; ++i) a[i] = 0x3C003C00u ^ ((threadIdx.x * 7 + i * 13) & 0x03FF03FFu);
    float d[NCH][N / 2];
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) d[c][i] = 0.0f;
    // FEED: each thread's words of 16 k-steps, 4 (f16) or 2 (e4m3) per k-step, conflict-free
    const unsigned* wsrc = (const unsigned*)smem + (threadIdx.x & 127);
    unsigned raw[2][GROUP][4];
    // FEED 3: ldmatrix.x4, two k-steps of e4m3 words per instruction (8 pairs x 4 warps x 512 B)
    const unsigned lsrc = sa + (((threadIdx.x >> 5) & 3) * 32 + (threadIdx.x & 31)) * 16;
#if FEED == 3
#pragma unroll
    for (int u = 0; u < GROUP; u += 2)
        ldsm4(lsrc + (u / 2) * 4 * 512, raw[0][u][0], raw[0][u][1], raw[0][u + 1][0], raw[0][u + 1][1]);
#elif FEED
#pragma unroll
    for (int u = 0; u < GROUP; ++u)
#pragma unroll
        for (int i = 0; i < (FEED == 1 ? 4 : 2); ++i) raw[0][u][i] = wsrc[(u * 4 + i) * 128];
#endif
    for (int it = 0; it < iters; it += 2) {{
        body<0>(it, raw, d, a, wsrc, lsrc, da, db);
        body<1>(it + 1, raw, d, a, wsrc, lsrc, da, db);
    }}
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    float s = 0.0f;
#pragma unroll
    for (int c = 0; c < NCH; ++c)
#pragma unroll
        for (int i = 0; i < N / 2; ++i) s += d[c][i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}
"""


def build(src: str):
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(src, "rate.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["--std=c++17", "--gpu-architecture=sm_90a"])
        except nvrtc.NVRTCError:
            raise RuntimeError(nvrtc.getProgramLog(prog)) from None
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    mod = cp.cuda.function.Module()
    mod.load(cubin)
    return mod.get_function("rate")


def main() -> None:
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
    c = cp.empty((8192, 8192), cp.float16)
    t = _cuda_time(lambda: cp.matmul(a, b, out=c), 5, warmup=1)
    blas = 2 * 8192 ** 3 / t / 1e12
    print(f"cublas f16 8192^3: {blas:.0f} TFLOP/s", flush=True)
    a = b = c = None  # free the 384 MB before the runs
    configs = [(n, nwg, nch, grp, ss, 0)
               for n in (64, 128, 256)
               for nwg in (1, 2, 3)
               for nch in ((1, 2) if n == 64 else (1,))
               for grp in (2, 4)
               for ss in (False, True)]
    configs += [(64, nwg, 1, grp, False, feed)
                for feed in (1, 2, 3) for nwg in (1, 2) for grp in (2, 4)]
    if len(sys.argv) > 1:
        configs = [cf for cf in configs if f"n{cf[0]}" in sys.argv[1:] or
                   (cf[5] and "feed" in sys.argv[1:])]
    for n, nwg, nch, grp, ss, feed in configs:
        fn = build(source(n, nwg, nch, grp, ss, feed))
        smem = max(4 * n * 32 + 4 * 64 * 32, 16 * 4 * 128 * 4)
        out = cp.empty(n_sm * nwg * 128, cp.float32)
        iters = max(1, 200_000 // (n * grp // 64))
        t = _cuda_time(lambda: fn((n_sm,), (nwg * 128,), (out, np.int32(iters)), shared_mem=smem),
                       5, warmup=1)
        flop = n_sm * nwg * iters * grp * 64 * n * 16 * 2
        r = flop / t / 1e12
        mode = "ss" if ss else ("rs", "rs+lds", "rs+lds+cvt", "rs+ldsm+cvt")[feed]
        print(f"m64n{n}k16 {mode} wg={nwg} chains={nch} group={grp}: "
              f"{r:.0f} TFLOP/s = {r / blas:.2f} x cublas", flush=True)


if __name__ == "__main__":
    main()
