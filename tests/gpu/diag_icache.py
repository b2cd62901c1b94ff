"""Diagnostic (not a test): how the time of a loop depends on the size of its code, to
find the instruction-cache capacity a kernel's step loop has to fit in.

    python3 tests/gpu/diag_icache.py

Each SM runs one CTA of 8 warps (two per sub-partition, as attn_wg's consumers); each warp
runs a loop whose body is N independent FFMAs (8 register chains, so that issue, not
latency, sets the pace), repeated R times. Printed per N: the body's bytes of SASS (16 per
instruction), and cycles per instruction per sub-partition. Where the body stops fitting
in the cache, every pass refetches it and the cycles per instruction rise. A second series
adds a never-taken branch over C extra instructions inside the body, as attn_wg's rare
rescale path is.
"""
import cupy as cp
import numpy as np

SRC = r"""
#ifndef COLD
#define COLD 0
#endif
extern "C" __global__ void __launch_bounds__(256) body(float* out, int reps, int never) {
    float a0 = threadIdx.x, a1 = a0 + 1, a2 = a0 + 2, a3 = a0 + 3, a4 = a0 + 4, a5 = a0 + 5,
          a6 = a0 + 6, a7 = a0 + 7;
    long long t0 = clock64();
    for (int r = 0; r < reps; ++r) {
        asm volatile(BODY : "+f"(a0), "+f"(a1), "+f"(a2), "+f"(a3), "+f"(a4), "+f"(a5), "+f"(a6), "+f"(a7));
#if COLD
        if (never == r + 12345)  // (never true: the kernel is called with never = -1)
            asm volatile(COLDBODY : "+f"(a0), "+f"(a1), "+f"(a2), "+f"(a3), "+f"(a4), "+f"(a5), "+f"(a6), "+f"(a7));
#endif
    }
    long long t1 = clock64();
    if (threadIdx.x == 0) out[blockIdx.x] = (float)(t1 - t0);
    if (a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 == 1.2345f) out[gridDim.x] = 1.0f;
}
"""


def _body(n: int) -> str:
    ops = "".join(f"fma.rn.f32 %{i % 8}, %{i % 8}, 0f3F800001, 0f3F000000;\\n" for i in range(n))
    return f'"{ops}"'


def cycles(n: int, cold: int = 0, reps: int = 200) -> float:
    src = f"#define BODY {_body(n)}\n"
    if cold:
        src += f"#define COLD 1\n#define COLDBODY {_body(cold)}\n"
    mod = cp.RawModule(code=src + SRC, options=("-arch=sm_90a",))
    fn = mod.get_function("body")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.zeros(sms + 1, cp.float32)
    fn((sms,), (256,), (out, np.int32(10), np.int32(-1)))  # warm
    fn((sms,), (256,), (out, np.int32(reps), np.int32(-1)))
    cyc = float(np.median(out[:sms].get()))
    return cyc / (reps * n * 2)  # two warps per sub-partition share its issue


def main() -> None:
    print("loop body N FFMAs (8 warps, 2 per sub-partition): cycles per instruction and "
          "sub-partition", flush=True)
    for n in (512, 1024, 1536, 1792, 1920, 2048, 2176, 2304, 2560, 3072, 4096):
        print(f"  N={n:5d} ({16 * n / 1024:5.1f} KB): {cycles(n):.3f}", flush=True)
    print("N = 1536 hot FFMAs with a never-taken branch over C more inside the loop", flush=True)
    for c in (0, 256, 512, 768, 1024, 1536):
        print(f"  C={c:5d} (hot {16 * 1536 / 1024:.1f} KB + cold {16 * c / 1024:4.1f} KB): "
              f"{cycles(1536, c) if c else cycles(1536):.3f}", flush=True)


if __name__ == "__main__":
    main()
