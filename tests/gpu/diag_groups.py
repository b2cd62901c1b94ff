"""Diagnostic (not a test): queries of more heads than one CTA takes (128 heads: two 64-head
CTAs per work item) timed with the plan sized for one CTA per item (before head_groups) and
for head_groups() CTAs per item, over the bench's planes, and the two contexts compared.

    python3 tests/gpu/diag_groups.py        # kv8 / tq4, 128 heads, 16 x 32k, 1 x 32k, 64 x 4k
"""
import os
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from cluster.bench.attention import DL, DR, SCALE, _device_planes, _graph_time  # noqa: E402
from kernels.cuda import attention as gpu  # noqa: E402
from kernels.tiers import get_tier  # noqa: E402


def main() -> None:
    rng = np.random.default_rng(0)
    H = int(os.environ.get("GROUPS_H", "128"))
    for B, T in ((16, 32768), (1, 32768), (64, 4096)):
        for name in ("kv8", "tq4"):
            tier = get_tier(name)
            planes, tables = _device_planes(tier, B, T, rng)
            q_lat = cp.random.standard_normal((B, H, DL), dtype=cp.float32)
            q_rope = cp.random.standard_normal((B, H, DR), dtype=cp.float32)
            per_sm = gpu.ctas_per_sm(tier, H, DL, DR)
            groups = gpu.head_groups(tier, H, DL, DR)
            rows, pos = np.arange(B), np.full(B, T - 1)
            out, times = {}, {}
            for label, g in (("one CTA per item", 1), (f"{groups} CTAs per item", groups)):
                plan = gpu.decode_plan(rows, pos, ctas_per_sm=per_sm, head_groups=g)
                fn = lambda: gpu.paged_mla_decode(tier, planes, tables, plan, q_lat, q_rope,  # noqa: E731
                                                  SCALE)
                out[g] = fn().get()
                times[g] = _graph_time(fn, 10)[0]
                print(f"groups {name} H={H} {B}x{T} [{label}]: W={plan.n_work} chunk {plan.chunk} "
                      f"CTAs {plan.n_work * groups}: {1e3 * times[g]:.4f} ms", flush=True)
            a, b = out[1], out[groups]
            rel = np.linalg.norm(a - b) / np.linalg.norm(a)
            print(f"groups {name} H={H} {B}x{T}: ratio {times[1] / times[groups]:.3f}, "
                  f"contexts differ by {rel:.1e} (relative norm), finite {np.isfinite(b).all()}",
                  flush=True)
            planes = tables = None
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
