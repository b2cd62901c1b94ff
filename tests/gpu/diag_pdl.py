"""Programmatic dependent launch, A/B in one process: KVFLEET_CUDA_PDL=0, =1, and =1 with
attn_wg's early trigger on (tuning PDLT=1: the combine placed on free SMs from attn_wg's start),
three interleaved rounds of CUDA-graph timings per case (the bench's _graph_time, 10 calls a
graph), and whether all give the same bits. On an H200:

    PYTHONPATH=. python3 tests/gpu/diag_pdl.py      # also writes $OUT/pdl_ab.json if OUT is set
"""
import json
import os

import cupy as cp
import numpy as np

from cluster.bench import attention as bench
from kernels.cuda import attention as gpu
from kernels.tiers import get_tier

VARIANTS = [("0", ""), ("1", ""), ("1", "PDLT=1")]  # KVFLEET_CUDA_PDL, KVFLEET_CUDA_WG_TUNING
CASES = [(16, 32768, (64, 16)), (64, 4096, (64,)), (1, 32768, (64,))]  # B, T, head counts


def main() -> None:
    saved = {k: os.environ.get(k) for k in ("KVFLEET_CUDA_PDL", "KVFLEET_CUDA_WG_TUNING")}
    try:
        run()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run() -> None:
    rng = np.random.default_rng(0)
    res = {}
    for B, T, heads in CASES:
        for tier_name in ("kv8", "tq4"):
            tier = get_tier(tier_name)
            planes, tables = bench._device_planes(tier, B, T, rng)
            for H in heads:
                plan = gpu.decode_plan(np.arange(B), np.full(B, T - 1),
                                       ctas_per_sm=gpu.ctas_per_sm(tier, H, bench.DL, bench.DR))
                ql = cp.random.standard_normal((B, H, bench.DL), dtype=cp.float32)
                qr = cp.random.standard_normal((B, H, bench.DR), dtype=cp.float32)

                def call():
                    return gpu.paged_mla_decode(tier, planes, tables, plan, ql, qr, bench.SCALE)

                name, outs = f"{tier_name} {H}h {B}x{T}", {}
                for rep in range(3):
                    for pdl, tuning in VARIANTS:
                        os.environ["KVFLEET_CUDA_PDL"] = pdl
                        os.environ["KVFLEET_CUDA_WG_TUNING"] = tuning
                        gpu._pdl_refused = False  # (each variant starts with PDL allowed)
                        refused = gpu.fallbacks["pdl_refused"]
                        t, method = bench._graph_time(call, 10)
                        key = f"PDL={pdl} {tuning}".strip()
                        if gpu.fallbacks["pdl_refused"] != refused:
                            key += " (REFUSED: plain launches)"
                        res.setdefault(f"{name} {key}", []).append(round(t * 1e3, 4))
                        if rep == 0:
                            outs[key] = call().get()
                first = next(iter(outs.values()))
                same = all(np.array_equal(o, first, equal_nan=True) for o in outs.values())
                print(f"{name}: " + ", ".join(f"{k} {res[name + ' ' + k]} ms" for k in outs)
                      + f", same bits {same}, timing {method}", flush=True)
            del planes, tables
            cp.get_default_memory_pool().free_all_blocks()
    print("fallbacks", dict(gpu.fallbacks))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pdl_ab.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
