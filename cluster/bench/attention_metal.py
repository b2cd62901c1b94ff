"""MLX (kernels/metal) vs numpy (kernels/cpu) paged MLA decode attention at the same shapes.

    kvfleet bench attention --backend metal --shapes 1x8192 16x2048 --heads 4 16 --cpu-divide 1
    python -m cluster.bench.attention_metal [--shapes 1x8192 16x2048] [--heads 4 16]

One row per (tier, B x T, heads): the best of --repeat calls of each backend (after a
warm-up) on the wall clock and on the process CPU clock (CPU-seconds of all threads, which
other load on a shared machine inflates far less), numpy's BLAS pinned to one thread, and
the ratio numpy / MLX (> 1: MLX faster). Through `kvfleet bench attention` every T is
divided by --cpu-divide, as for --backend cpu.

The MLX device is kernels.metal.backend.device(): the Metal GPU on a Mac (unless
KVFLEET_METAL=0), where the hand-written kernel serves the call if its self-check passes;
elsewhere MLX's CPU backend. On Linux the mlx[cpu] wheel links the netlib reference BLAS
(mlx_cpu.libs/libblas), so its matmuls run at a few GFLOP/s: figures taken there say how
the op path behaves, nothing about a Mac. Metal figures need a Mac.
"""
from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

from cluster.bench.attention import divided, parse_shape
from cluster.bench.timing import CLOCKS, best_seconds, blas_threads
from kernels.cpu import attention as cpu_attn
from kernels.cpu import codecs as cpu_codecs
from kernels.metal import attention as mlx_attn
from kernels.metal import backend
from kernels.metal.backend import KernelStats
from kernels.tiers import get_tier

DL, DR, BS = 512, 64, 16
SCALE = 1.0 / np.sqrt(192.0)


def _planes(rng, tier, B, T):
    """B slots of T tokens each, blocks shuffled, rows encoded with the numpy codec."""
    nb = -(-T // BS)
    n = B * nb * BS
    lc, ls = cpu_codecs.encode_rows(tier, rng.standard_normal((n, DL), dtype=np.float32))
    rc, rs = cpu_codecs.encode_rows(tier, rng.standard_normal((n, DR), dtype=np.float32))
    planes = cpu_attn.LayerPlanes(lc.reshape(B * nb, BS, -1), ls.reshape(B * nb, BS),
                                  rc.reshape(B * nb, BS, -1), rs.reshape(B * nb, BS))
    return planes, rng.permutation(B * nb).astype(np.int32).reshape(B, nb)


def bench_one(tier_name: str, B: int, T: int, H: int, repeat: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tier = get_tier(tier_name)
    planes, tables = _planes(rng, tier, B, T)
    ql = rng.standard_normal((B, 1, H, DL), dtype=np.float32)
    qr = rng.standard_normal((B, 1, H, DR), dtype=np.float32)
    pos = np.full((B, 1), T - 1)
    mplanes = cpu_attn.LayerPlanes(*(mx.array(a) for a in (planes.l_codes, planes.l_scale,
                                                          planes.r_codes, planes.r_scale)))
    mql, mqr = mx.array(ql), mx.array(qr)
    mx.eval(mql, mqr, mplanes.l_codes, mplanes.l_scale, mplanes.r_codes, mplanes.r_scale)
    stats = KernelStats()

    def run_np():
        return cpu_attn.paged_mla_attention(tier, planes, tables, ql, qr, pos, SCALE)

    def run_mx():
        return mx.eval(mlx_attn.paged_mla_attention(tier, mplanes, tables, mql, mqr, pos,
                                                    SCALE, stats=stats))
    out = {"tier": tier_name, "B": B, "T": T, "H": H}
    for clock in ("wall", "cpu"):
        t_np = best_seconds(run_np, repeat, clock=CLOCKS[clock])
        t_mx = best_seconds(run_mx, repeat, clock=CLOCKS[clock])
        out.update({f"numpy_ms_{clock}": 1e3 * t_np, f"mlx_ms_{clock}": 1e3 * t_mx,
                    f"ratio_{clock}": t_np / t_mx})
    got, want = np.array(mlx_attn.paged_mla_attention(tier, mplanes, tables, mql, mqr, pos, SCALE)), run_np()
    out["max_rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
    out["path"] = "native" if stats.native else "mlx-ops"
    return out


def bench(shapes, heads, tiers, repeat: int) -> dict:
    dev = backend.device()
    with blas_threads(1) as numpy_threads, mx.stream(dev):
        rows = [bench_one(t, B, T, H, repeat) for t in tiers for B, T in shapes for H in heads]
    return {"backend": "metal", "mlx": mx.__version__, "device": str(dev),
            "metal_available": backend.metal_available(), "numpy_blas_threads": numpy_threads,
            "rows": rows}


def render(res: dict) -> str:
    lines = [f"MLX {res['mlx']} on {res['device']} (Metal available: {res['metal_available']}),"
             f" numpy BLAS threads {res['numpy_blas_threads']}; decode, Dl {DL}, Dr {DR}, "
             f"block {BS}; best of repeats"]
    if not res["metal_available"]:
        lines.append("MLX runs on its CPU backend (reference BLAS): Metal figures need a Mac")
    lines.append(f"{'tier':5} {'BxT':>9} {'H':>3} | {'wall: numpy':>11} {'mlx':>8} {'np/mlx':>6} "
                 f"| {'cpu: numpy':>10} {'mlx':>8} {'np/mlx':>6} | {'rel err':>8} path")
    for r in res["rows"]:
        lines.append(f"{r['tier']:5} {r['B']:>3}x{r['T']:<5} {r['H']:>3} | "
                     f"{r['numpy_ms_wall']:9.1f}ms {r['mlx_ms_wall']:6.1f}ms {r['ratio_wall']:6.2f} | "
                     f"{r['numpy_ms_cpu']:8.1f}ms {r['mlx_ms_cpu']:6.1f}ms {r['ratio_cpu']:6.2f} | "
                     f"{r['max_rel_err']:8.1e} {r['path']}")
    return "\n".join(lines)


def run(args) -> int:
    """Entry from `kvfleet bench attention --backend metal` (T divided by --cpu-divide)."""
    shapes = [(B, divided(T, args.cpu_divide)) for B, T in args.shapes]
    res = bench(shapes, args.head_counts, args.tiers, args.repeat)
    print(json.dumps(res, indent=1) if args.json else render(res))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.bench.attention_metal",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[(1, 8192), (16, 2048)], metavar="BxT")
    ap.add_argument("--heads", dest="head_counts", nargs="+", type=int, default=[4, 16])
    ap.add_argument("--tiers", nargs="+", default=["f32", "kv8", "tq4"], choices=["f32", "kv8", "tq4"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cpu-divide", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
