"""`kvfleet bench attention`: paged MLA decode attention per KV tier against its floor.

    kvfleet bench attention --backend cuda [--json] [--shapes 16x32768 ...] [--heads 64 16]
    python -m cluster.bench.attention --backend cuda

For every B x T (slots x context) and head count, each tier's time per layer (CUDA events,
warm-up, median of --repeat), the bandwidth achieved on the tier's own cache bytes, and the
floor max(bytes / read bandwidth, FLOPs / tensor rate), with both ceilings measured in the
same run: a kernel that only reads a 2 GiB buffer (16-byte loads) and a cuBLAS f16 matrix
product (cupy.matmul, f32 accumulate). A device-to-device copy (bytes read + written) is
reported beside them, not used. FLOPs = 2 * H * (kv_lora + rope + kv_lora) per token.
--backend cpu times the numpy path at sizes divided by --cpu-divide (no floor).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from kernels.tiers import get_tier

SHAPES = ["1x32768", "1x131072", "16x8192", "16x32768", "64x4096", "64x16384"]
HEADS = [64, 16]
TIERS = ["f32", "kv8", "tq4"]
DL, DR, BS = 512, 64, 16
SCALE = 1.0 / np.sqrt(192.0)


def parse_shape(s: str) -> tuple[int, int]:
    try:
        b, t = s.lower().split("x")
        b, t = int(b), int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes entry {s!r} must look like 16x32768") from None
    if b < 1 or t < 1:
        raise argparse.ArgumentTypeError(f"--shapes entry {s!r}: B and T must be >= 1")
    return b, t


def _at_least_one(flag: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {s!r} is not an integer") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {v}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["cuda", "cpu", "metal"], default="cuda")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in SHAPES],
                   metavar="BxT")
    p.add_argument("--heads", dest="head_counts", nargs="+", type=_at_least_one("--heads"),
                   default=HEADS)
    p.add_argument("--tiers", nargs="+", default=TIERS, choices=TIERS)
    p.add_argument("--repeat", type=_at_least_one("--repeat"), default=20)
    p.add_argument("--cpu-divide", type=_at_least_one("--cpu-divide"), default=64,
                   help="cpu and metal backends: divide every T, --shapes too, by this "
                   "(numpy is slow; 1 runs the shapes as given)")
    p.add_argument("--breakdown", action="store_true",
                   help="cuda: also time variants that leave stages out (16x32768)")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def divided(T: int, cpu_divide: int) -> int:
    """The context length the cpu / metal backends time for a --shapes T (numpy is slow)."""
    return max(BS, T // cpu_divide)


def flops_per_token(H: int) -> int:
    return 2 * H * (DL + DR + DL)


# ---- CUDA ------------------------------------------------------------------------------

def _cuda_time(fn, repeat: int, warmup: int = 3) -> float:
    """Median seconds of fn() between CUDA events on the current stream."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return statistics.median(times)


CALLS_PER_GRAPH = 10


def _graph_time(fn, repeat: int) -> tuple[float, str]:
    """Median seconds per call of fn() replayed from a CUDA graph of CALLS_PER_GRAPH calls
    (device time without Python launch gaps, as a serving loop with graphs sees it), or
    of back-to-back calls on a stream when capture is refused. Returns (seconds, method)."""
    import cupy as cp
    # Inputs were made on the legacy default stream, which a non-blocking stream does not
    # wait for: finish them first.
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):  # warm-up: compiles, and fills the memory pool with the buffers
            fn()
        stream.synchronize()
        try:
            stream.begin_capture()
            for _ in range(CALLS_PER_GRAPH):
                fn()
            graph = stream.end_capture()
            run, method = (lambda: graph.launch(stream)), "graph"
        except RuntimeError as e:  # (CUDARuntimeError, or a launch refused during the capture)
            print(f"bench attention: graph capture refused ({e}); timing stream calls",
                  file=sys.stderr)
            try:
                stream.end_capture()  # (a launch refused mid-capture leaves it open)
            except Exception:  # noqa: BLE001  (not capturing any more: nothing to end)
                pass
            stream.synchronize()

            def run():
                for _ in range(CALLS_PER_GRAPH):
                    fn()
            method = "stream"
        run()
        stream.synchronize()
        times = []
        for _ in range(repeat):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            run()
            b.record(stream)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3 / CALLS_PER_GRAPH)
    return statistics.median(times), method


# Reads n 16-byte words (four independent loads in flight per thread and pass) and folds
# them into one word per thread, stored only if it matches a constant, so that the loads
# cannot be dropped and almost nothing is written.
_READ_SRC = r"""
extern "C" __global__ void read_only(const uint4* __restrict__ src, unsigned long long n,
                                     unsigned* __restrict__ sink) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride);
        const uint4 c = __ldcs(src + i + 2 * stride), d = __ldcs(src + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^
               d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = __ldcs(src + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;
}
"""


def measure_ceilings(repeat: int) -> dict:
    """Read bandwidth (a kernel that only reads a 2 GiB buffer: the floor's byte rate, as
    the attention kernels read their cache and write little), copy bandwidth (read + write
    bytes of a 2 GiB copy, reported only) and f16 tensor rate (cuBLAS; issue 6 names bf16,
    which CuPy has no product for: on the H200 the two measured equal within their spread,
    docs/benchmarks/2026-12-01-h200-attention-sm90-s16.md)."""
    import cupy as cp
    src = cp.random.random(2 ** 28, dtype=cp.float64)  # 2 GiB
    dst = cp.empty_like(src)
    t = _cuda_time(lambda: cp.copyto(dst, src), repeat)
    bw = 2 * src.nbytes / t
    del dst
    fn = cp.RawKernel(_READ_SRC, "read_only")
    sink = cp.zeros(1, cp.uint32)
    n_words = src.nbytes // 16
    blocks = 8 * cp.cuda.Device().attributes["MultiProcessorCount"]
    t = _cuda_time(lambda: fn((blocks,), (256,), (src, np.uint64(n_words), sink)), repeat)
    read_bw = src.nbytes / t
    del src, sink
    n = 8192
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    c = cp.empty((n, n), cp.float16)
    t = _cuda_time(lambda: cp.matmul(a, b, out=c), repeat)
    del a, b, c
    cp.get_default_memory_pool().free_all_blocks()
    return {"read_bytes_per_s": read_bw, "copy_bytes_per_s": bw, "f16_flops_per_s": 2 * n ** 3 / t}


def best_ceilings(runs: list[dict]) -> dict:
    """The ceilings of several measure_ceilings() calls: each the highest rate seen. The
    8192^3 product's rate moves with the GPU's temperature (H200, 2026-12-01: 707 and 757
    TFLOP/s from two calls seconds apart), so a floor from one measurement could decide the
    1.3x targets either way."""
    if not runs:
        raise ValueError("best_ceilings: no measurements")
    return {k: max(r[k] for r in runs) for k in runs[0]}


def apply_floors(rows: list[dict], ceil: dict) -> None:
    """Fill each timed row's floor (max of its bytes over the read rate and its FLOPs over
    the f16 tensor rate), its time over that floor, and which bound it is."""
    for r in rows:
        by_bytes = r["bytes"] / ceil["read_bytes_per_s"]
        by_flops = r["flops"] / ceil["f16_flops_per_s"]
        floor = max(by_bytes, by_flops)
        r["floor_ms"] = 1e3 * floor
        r["x_floor"] = r["ms"] * 1e-3 / floor
        r["bound"] = "bytes" if by_bytes >= by_flops else "flops"


def _device_planes(tier, B: int, T: int, rng):
    """B slots of T tokens, random codes made on the device, blocks shuffled."""
    import cupy as cp
    from kernels.cpu.attention import LayerPlanes
    nb = -(-T // BS)
    n_blocks = B * nb
    wl, wr = tier.code_width(DL), tier.code_width(DR)
    if tier.kind == "f32":
        lc = cp.random.standard_normal((n_blocks, BS, wl), dtype=cp.float32)
        rc = cp.random.standard_normal((n_blocks, BS, wr), dtype=cp.float32)
        ls = cp.ones((n_blocks, BS), cp.float32)
        rs = cp.ones((n_blocks, BS), cp.float32)
    else:
        lc = cp.random.randint(0, 256, (n_blocks, BS, wl), dtype=cp.int32).astype(cp.uint8)
        rc = cp.random.randint(0, 256, (n_blocks, BS, wr), dtype=cp.int32).astype(cp.uint8)
        if tier.kind == "fp8":  # keep the e4m3 NaN codes (0x7F, 0xFF) out, values up to +-448
            lc[(lc & 0x7F) == 0x7F] -= 1
            rc[(rc & 0x7F) == 0x7F] -= 1
            ls = cp.random.uniform(0.005, 0.02, (n_blocks, BS), dtype=cp.float32)
            rs = cp.random.uniform(0.005, 0.02, (n_blocks, BS), dtype=cp.float32)
        else:
            ls = cp.random.uniform(10.0, 30.0, (n_blocks, BS), dtype=cp.float32)
            rs = cp.random.uniform(4.0, 10.0, (n_blocks, BS), dtype=cp.float32)
    tables = cp.asarray(rng.permutation(n_blocks).astype(np.int32).reshape(B, nb))
    return LayerPlanes(lc, ls, rc, rs), tables


def bench_cuda(args) -> dict:
    import cupy as cp
    from kernels.cuda import attention as cuda_attention
    rng = np.random.default_rng(0)
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    ceil_runs = [measure_ceilings(args.repeat)]  # (again after the rows: best_ceilings)
    rows = []
    for B, T in args.shapes:
        for tier_name in args.tiers:
            tier = get_tier(tier_name)
            planes, tables = _device_planes(tier, B, T, rng)
            nbytes = B * T * tier.token_bytes(DL, DR)
            for H in args.head_counts:
                plan = cuda_attention.decode_plan(
                    np.arange(B), np.full(B, T - 1), ctas_per_sm=cuda_attention.ctas_per_sm(
                        tier, H, DL, DR), head_groups=cuda_attention.head_groups(tier, H, DL, DR))
                q_lat = cp.random.standard_normal((B, H, DL), dtype=cp.float32)
                q_rope = cp.random.standard_normal((B, H, DR), dtype=cp.float32)
                fn = lambda: cuda_attention.paged_mla_decode(  # noqa: E731
                    tier, planes, tables, plan, q_lat, q_rope, SCALE)
                t, method = _graph_time(fn, args.repeat)
                flops = B * T * flops_per_token(H)
                rows.append({"tier": tier_name, "B": B, "T": T, "H": H, "ms": 1e3 * t,
                             "GB_per_s": nbytes / t / 1e9, "TFLOP_per_s": flops / t / 1e12,
                             "bytes": nbytes, "flops": flops,
                             "splits": plan.n_work, "timing": method,
                             "kernel": cuda_attention.kernel_path(tier, H, DL, DR, BS)})
            del planes, tables
            cp.get_default_memory_pool().free_all_blocks()
    ceil_runs.append(measure_ceilings(args.repeat))
    ceil = best_ceilings(ceil_runs)
    apply_floors(rows, ceil)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    res = {"backend": "cuda", "device": name, "sms": props["multiProcessorCount"],
           **ceil, "ceiling_runs": ceil_runs, "rows": rows, "checks": _checks(rows)}
    if args.breakdown:
        res["breakdown"] = breakdown(args, ceil)
    return res


SKIPS = {"full": 0, "no convert": 1, "no scores": 2, "no context": 4, "no loads": 8,
         "loads only": 1 | 2 | 4, "no mma": 2 | 4}


def breakdown(args, ceil) -> list[dict]:
    """Time of variants that leave stages out (attention.cu SKIP; results discarded) at
    16 x 32768: where a tile's time goes. Every variant, "full" included, runs attention.cu
    with its own plan (KVFLEET_CUDA_WGMMA=0 meanwhile): SKIP exists there only, and on sm_90
    "full" and "1 CTA/SM" would otherwise time attn_wg beside the stripped attention.cu."""
    from kernels.cuda import attention as cuda_attention
    old = os.environ.get(cuda_attention.WG_ENV)
    os.environ[cuda_attention.WG_ENV] = "0"
    try:
        return _breakdown_rows(args)
    finally:
        if old is None:
            del os.environ[cuda_attention.WG_ENV]
        else:
            os.environ[cuda_attention.WG_ENV] = old


def _breakdown_rows(args) -> list[dict]:
    import cupy as cp
    from kernels.cuda import attention as cuda_attention
    rng = np.random.default_rng(1)
    B, T = 16, 32768
    out = []
    for tier_name in args.tiers:
        tier = get_tier(tier_name)
        planes, tables = _device_planes(tier, B, T, rng)
        for H in args.head_counts:
            q_lat = cp.random.standard_normal((B, H, DL), dtype=cp.float32)
            q_rope = cp.random.standard_normal((B, H, DR), dtype=cp.float32)
            row = {"tier": tier_name, "H": H}
            plan = cuda_attention.decode_plan(np.arange(B), np.full(B, T - 1), ctas_per_sm=(
                cuda_attention.ctas_per_sm(tier, H, DL, DR)), head_groups=(
                cuda_attention.head_groups(tier, H, DL, DR)))
            for name, skip in SKIPS.items():
                fn = lambda: cuda_attention.paged_mla_decode(  # noqa: E731
                    tier, planes, tables, plan, q_lat, q_rope, SCALE, _skip=skip)
                row[name] = 1e3 * _graph_time(fn, max(5, args.repeat // 2))[0]
            plan1 = cuda_attention.decode_plan(np.arange(B), np.full(B, T - 1))
            fn = lambda: cuda_attention.paged_mla_decode(  # noqa: E731
                tier, planes, tables, plan1, q_lat, q_rope, SCALE, _two_ctas=False)
            row["1 CTA/SM"] = 1e3 * _graph_time(fn, max(5, args.repeat // 2))[0]
            out.append(row)
        del planes, tables
        cp.get_default_memory_pool().free_all_blocks()
    return out


def _checks(rows) -> list[str]:
    by = {(r["tier"], r["B"], r["T"], r["H"]): r for r in rows}
    out = []
    for tier in ("kv8", "tq4"):
        r = by.get((tier, 16, 32768, 64))
        if r:
            out.append(f"{tier} 64 heads 16x32k: {r['ms']:.3f} ms = {r['x_floor']:.2f}x floor "
                       f"(target <= 1.3x): {'PASS' if r['x_floor'] <= 1.3 else 'MISS'}")
    a, b = by.get(("f32", 16, 32768, 16)), by.get(("tq4", 16, 32768, 16))
    if a and b:
        sp = a["ms"] / b["ms"]
        out.append(f"tq4 vs f32, 16 heads 16x32k: {sp:.2f}x faster (target >= 3x): "
                   f"{'PASS' if sp >= 3 else 'MISS'}")
    return out


# ---- CPU (numpy) -------------------------------------------------------------------------

def bench_cpu(args) -> dict:
    from kernels.cpu import codecs
    from kernels.cpu.attention import LayerPlanes, paged_mla_attention
    from kernels.cpu.consumers import WorkCounter
    rng = np.random.default_rng(0)
    rows = []
    for B, T0 in args.shapes:
        T = divided(T0, args.cpu_divide)
        nb = -(-T // BS)
        for tier_name in args.tiers:
            tier = get_tier(tier_name)
            n = B * nb * BS
            lc, ls = codecs.encode_rows(tier, rng.standard_normal((n, DL), dtype=np.float32))
            rc, rs = codecs.encode_rows(tier, rng.standard_normal((n, DR), dtype=np.float32))
            planes = LayerPlanes(lc.reshape(B * nb, BS, -1), ls.reshape(B * nb, BS),
                                 rc.reshape(B * nb, BS, -1), rs.reshape(B * nb, BS))
            tables = rng.permutation(B * nb).astype(np.int32).reshape(B, nb)
            for H in args.head_counts:
                ql = rng.standard_normal((B, 1, H, DL), dtype=np.float32)
                qr = rng.standard_normal((B, 1, H, DR), dtype=np.float32)
                pos = np.full((B, 1), T - 1)
                times = []
                for i in range(1 + args.repeat):  # (the first call is a warm-up, untimed)
                    t0 = time.perf_counter()
                    paged_mla_attention(tier, planes, tables, ql, qr, pos, SCALE,
                                        counter=WorkCounter())
                    if i:
                        times.append(time.perf_counter() - t0)
                t = statistics.median(times)
                nbytes = B * T * tier.token_bytes(DL, DR)
                rows.append({"tier": tier_name, "B": B, "T": T, "H": H, "ms": 1e3 * t,
                             "repeats": len(times),
                             "GB_per_s": nbytes / t / 1e9,
                             "TFLOP_per_s": B * T * flops_per_token(H) / t / 1e12})
    return {"backend": "cpu", "cpu_divide": args.cpu_divide,
            "shapes": [[B, T] for B, T in args.shapes], "rows": rows}


def _print_table(res: dict) -> None:
    if res["backend"] == "cuda":
        print(f"device {res['device']} ({res['sms']} SMs); measured read "
              f"{res['read_bytes_per_s'] / 1e12:.2f} TB/s (copy "
              f"{res['copy_bytes_per_s'] / 1e12:.2f} TB/s read+write, not used), f16 cuBLAS "
              f"{res['f16_flops_per_s'] / 1e12:.0f} TFLOP/s (the best of "
              + ", ".join(f"{r['f16_flops_per_s'] / 1e12:.0f}" for r in res["ceiling_runs"])
              + ", before and after the rows)")
        print(f"{'tier':5} {'BxT':>9} {'H':>3} {'ms':>8} {'GB/s':>7} {'TFLOP/s':>8} "
              f"{'floor ms':>9} {'x floor':>7} bound")
        for r in res["rows"]:
            print(f"{r['tier']:5} {r['B']:>3}x{r['T']:<6} {r['H']:>3} {r['ms']:8.3f} "
                  f"{r['GB_per_s']:7.0f} {r['TFLOP_per_s']:8.1f} {r['floor_ms']:9.3f} "
                  f"{r['x_floor']:7.2f} {r['bound']}")
        for c in res["checks"]:
            print(c)
        if res.get("breakdown"):
            names = list(SKIPS) + ["1 CTA/SM"]
            print("breakdown at 16x32768, ms per call: " + " | ".join(names))
            for r in res["breakdown"]:
                print(f"{r['tier']:5} H={r['H']:<3} " + " ".join(f"{r[n]:8.3f}" for n in names))
    else:
        asked = ", ".join(f"{B}x{T} -> {B}x{divided(T, res['cpu_divide'])}" for B, T in res["shapes"])
        print(f"numpy backend: T divided by --cpu-divide {res['cpu_divide']} ({asked}); no floor "
              f"(the floor needs --backend cuda)")
        print(f"{'tier':5} {'BxT':>9} {'H':>3} {'ms':>9} {'GB/s':>7}")
        for r in res["rows"]:
            print(f"{r['tier']:5} {r['B']:>3}x{r['T']:<6} {r['H']:>3} {r['ms']:9.2f} "
                  f"{r['GB_per_s']:7.2f}")


def _check_cuda() -> None:
    """--backend cuda (the default) on a machine without CuPy or a GPU: a UsageError that
    says what to install or which backend to pick, not an ImportError traceback."""
    from cluster.cli import UsageError
    try:
        import cupy as cp
    except ImportError:
        raise UsageError("--backend cuda needs CuPy and an NVIDIA GPU (pip install -e '.[cuda]'); "
                         "on this machine use --backend cpu (numpy) or --backend metal (MLX)") from None
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError as e:
        raise UsageError(f"--backend cuda: CuPy finds no CUDA device ({e}); use --backend cpu "
                         f"or --backend metal") from None
    if n == 0:
        raise UsageError("--backend cuda: CuPy finds no CUDA device; use --backend cpu or "
                         "--backend metal")


def run(args) -> int:
    if args.backend == "metal":  # MLX vs numpy: cluster/bench/attention_metal.py
        from cluster.bench import attention_metal
        return attention_metal.run(args)
    if args.backend == "cuda":
        _check_cuda()
    res = bench_cuda(args) if args.backend == "cuda" else bench_cpu(args)
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
    else:
        _print_table(res)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvfleet bench attention", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
