"""Diagnostic (not a test): the tensor-core rate that one shape of wgmma can reach, so that
the attention kernel's time can be set against what its instruction shape allows.

    python3 tests/gpu/diag_wgmma_rate.py

Every multiprocessor runs one CTA of NWG warpgroups; each warpgroup issues a chain of
m64nNk16 f16 wgmma (A from registers "rs" or shared memory "ss", B from shared memory,
f32 accumulators) into NCH accumulators in turn, GROUP instructions per commit group with
one group left in flight, as attn_wg does. Operands are random halves (tensor-core power
depends on the data). Printed: TFLOP/s of each configuration and its ratio to cuBLAS f16
(cupy.matmul 8192^3) measured in the same run.
"""
import sys

import cupy as cp
import numpy as np


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


def source(n: int, nwg: int, nch: int, group: int, ss: bool) -> str:
    return _wgmma_fn(n, ss) + f"""
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
extern "C" __global__ void __launch_bounds__(NWG * 128, 1) rate(float* out, int iters) {{
    extern __shared__ __align__(1024) unsigned char smem[];
    // B: TILES k-steps of N x 16 halves (canonical K-major: 8-row x 16-byte core matrices);
    // A (ss): TILES k-steps of 64 x 16 halves after them.
    const int bbytes = TILES * N * 32, abytes = TILES * 64 * 32;
    unsigned* w = (unsigned*)smem;
    for (int i = threadIdx.x; i < (bbytes + abytes) / 4; i += blockDim.x) {{
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
    for (int it = 0; it < iters; ++it) {{
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int u = 0; u < GROUP; ++u) {{
            const int t = (it * GROUP + u) % TILES;
            mma(d[u % NCH], a, da + (u64)(t * 64 * 32 / 16), db + (u64)(t * N * 32 / 16), 1);
        }}
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
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


def time_fn(fn, repeat: int = 5) -> float:
    fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(repeat):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
    return float(np.median(ts))


def main() -> None:
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
    c = cp.empty((8192, 8192), cp.float16)
    t = time_fn(lambda: cp.matmul(a, b, out=c))
    blas = 2 * 8192 ** 3 / t / 1e12
    print(f"cublas f16 8192^3: {blas:.0f} TFLOP/s", flush=True)
    a = b = c = None  # free the 384 MB before the runs
    configs = [(n, nwg, nch, grp, ss)
               for n in (64, 128, 256)
               for nwg in (1, 2, 3)
               for nch in ((1, 2) if n == 64 else (1,))
               for grp in (2, 4)
               for ss in (False, True)]
    if len(sys.argv) > 1:
        configs = [cf for cf in configs if f"n{cf[0]}" in sys.argv[1:]]
    for n, nwg, nch, grp, ss in configs:
        fn = build(source(n, nwg, nch, grp, ss))
        smem = 4 * n * 32 + 4 * 64 * 32
        out = cp.empty(n_sm * nwg * 128, cp.float32)
        iters = max(1, 200_000 // (n * grp // 64))
        t = time_fn(lambda: fn((n_sm,), (nwg * 128,), (out, np.int32(iters)), shared_mem=smem))
        flop = n_sm * nwg * iters * grp * 64 * n * 16 * 2
        r = flop / t / 1e12
        print(f"m64n{n}k16 {'ss' if ss else 'rs'} wg={nwg} chains={nch} group={grp}: "
              f"{r:.0f} TFLOP/s = {r / blas:.2f} x cublas", flush=True)


if __name__ == "__main__":
    main()
