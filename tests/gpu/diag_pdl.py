"""Programmatic dependent launch, A/B in one process (KVFLEET_CUDA_PDL 0 / 1): three
interleaved pairs of CUDA-graph timings per case (the bench's _graph_time, 10 calls a graph),
and whether both give the same bits. On an H200:

    PYTHONPATH=. python3 tests/gpu/diag_pdl.py      # also writes $OUT/pdl_ab.json if OUT is set
"""
import json
import os

import cupy as cp
import numpy as np

from cluster.bench import attention as bench
from kernels.cuda import attention as gpu
from kernels.tiers import get_tier

CASES = [(16, 32768, (64, 16)), (64, 4096, (64,)), (1, 32768, (64,))]  # B, T, head counts


def main() -> None:
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
                    for pdl in ("0", "1"):
                        os.environ["KVFLEET_CUDA_PDL"] = pdl
                        t, method = bench._graph_time(call, 10)
                        res.setdefault(f"{name} PDL={pdl}", []).append(round(t * 1e3, 4))
                        if rep == 0:
                            outs[pdl] = call().get()
                same = np.array_equal(outs["0"], outs["1"], equal_nan=True)
                print(f"{name}: PDL=0 {res[name + ' PDL=0']} ms, PDL=1 {res[name + ' PDL=1']} ms, "
                      f"same bits {same}, timing {method}", flush=True)
            del planes, tables
            cp.get_default_memory_pool().free_all_blocks()
    print("fallbacks", dict(gpu.fallbacks))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pdl_ab.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
