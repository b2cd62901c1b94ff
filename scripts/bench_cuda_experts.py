"""Routed experts on a cuda worker: the bucketed batched GEMMs (workers.moe.batched_expert_sum
with workers.cuda_model.batched_gated_mlp) against the expert-at-a-time loop they replaced
(workers.moe.grouped_expert_sum with cuda_model.gated_mlp), and how much of a SplitShard's
host part (experts in host memory, numpy) hides behind its device part. One run, the same
data, the calls of each case interleaved in a new random order every round.

    python scripts/bench_cuda_experts.py [--tokens 1 16 64 512] [--host-share 0.125 0.5]

Shapes: DeepSeek-V2-Lite's MoE (hidden 2048, moe_intermediate 1408, 64 routed experts, 6
picks a token), float32 as the cuda worker holds them; random weights and routing. Each
figure is the median wall time of --repeat calls that end with a device synchronize.

- loop / batched: all 64 experts on the GPU (ExpertShard on CuPy), all picks; speedup =
  loop / batched.
- split: a SplitShard with --host-share of the experts in host memory; dev its device part
  alone (host picks masked out), host its host part alone with its transfers;
  overlap = (dev + host - split) / min(dev, host): 1 when the shorter part is hidden whole,
  0 when they run one after the other.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYER = 1


def _interleaved(fns: dict, sync, repeat: int, rng) -> dict:
    """Median seconds per call of each fn, interleaved in a new random order each round (so
    that drift, BLAS threads waking, the GPU's clock, falls on all of them alike)."""
    names = list(fns)
    for f in fns.values():
        f()
    sync()  # (warm-up: cuBLAS handles, kernel compiles, pool growth)
    ts = {n: [] for n in names}
    for _ in range(repeat):
        for n in rng.permutation(names):
            t0 = time.perf_counter()
            fns[n]()
            sync()
            ts[n].append(time.perf_counter() - t0)
    return {n: float(np.median(v)) for n, v in ts.items()}


def _routing(rng, N: int, E: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    idx = np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.int64)
    return idx, rng.random((N, k), np.float32)


def run(tokens: list[int], shares: list[float], repeat: int, hidden: int, inter: int,
        n_experts: int, k: int) -> list[dict]:
    import cupy as cp
    from workers import cuda_model
    from workers.expert_shard import ExpertShard, SplitShard
    from workers.moe import grouped_expert_sum

    rng = np.random.default_rng(0)
    gate = (rng.standard_normal((n_experts, inter, hidden), np.float32) / np.sqrt(hidden)).astype(np.float32)
    up = (rng.standard_normal((n_experts, inter, hidden), np.float32) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.standard_normal((n_experts, hidden, inter), np.float32) / np.sqrt(inter)).astype(np.float32)
    sync = cp.cuda.Device().synchronize
    ids = np.arange(n_experts)
    full = ExpertShard(n_experts, cp)
    full.put(LAYER, ids, gate, up, down)
    gu, dn = full._layers[LAYER][2]
    rows = []
    for N in tokens:
        x = cp.asarray(rng.standard_normal((N, hidden), np.float32))
        idx, w = _routing(rng, N, n_experts, k)
        loop = lambda: grouped_expert_sum(  # noqa: E731
            x, idx, w, lambda e, r: cuda_model.gated_mlp(r, gu[e], dn[e]), cp)
        err = float(cp.abs(full.compute(LAYER, x, idx, w) - loop()).max() /
                    cp.abs(loop()).max())
        t = _interleaved({"loop": loop, "batched": lambda: full.compute(LAYER, x, idx, w)},
                         sync, repeat, rng)
        r = dict(case="device", tokens=N, loop_ms=1e3 * t["loop"], batched_ms=1e3 * t["batched"],
                 speedup=t["loop"] / t["batched"], max_rel_diff=err)
        rows.append(r)
        print(f"experts N={N:4d}, all {n_experts} on the GPU: loop {r['loop_ms']:.3f} ms, "
              f"batched {r['batched_ms']:.3f} ms: {r['speedup']:.2f}x (max |diff| / max "
              f"{err:.1e})", flush=True)
    for share in shares:
        n_host = max(1, int(round(share * n_experts)))
        on_host = np.zeros(n_experts, bool)
        on_host[rng.permutation(n_experts)[:n_host]] = True
        shard = SplitShard(ExpertShard(n_experts, cp), ExpertShard(n_experts))
        shard.add(LAYER, ids, gate, up, down, pinned=~on_host)
        for N in tokens:
            x = cp.asarray(rng.standard_normal((N, hidden), np.float32))
            idx, w = _routing(rng, N, n_experts, k)
            if not on_host[idx].any():  # (no host pick: nothing to overlap)
                idx[0, 0] = np.flatnonzero(on_host & ~np.isin(ids, idx[0]))[0]
            host_pick = on_host[idx]
            sel = np.flatnonzero(host_pick.any(axis=1))
            dev_idx = np.where(host_pick, -1, idx)

            def host_part():
                xs = x[cp.asarray(sel)].get()
                return cp.asarray(shard.host.compute(LAYER, xs, np.where(host_pick[sel], idx[sel], -1),
                                                     w[sel]))

            t = _interleaved({"dev": lambda: shard.dev.compute(LAYER, x, dev_idx, w),
                              "host": host_part, "split": lambda: shard.compute(LAYER, x, idx, w)},
                             sync, repeat, rng)
            r = dict(case="split", tokens=N, host_share=n_host / n_experts,
                     host_picks=int(host_pick.sum()), picks=int(idx.size),
                     **{f"{n}_ms": 1e3 * v for n, v in t.items()},
                     overlap=(t["dev"] + t["host"] - t["split"]) / min(t["dev"], t["host"]))
            rows.append(r)
            print(f"split N={N:4d}, {n_host}/{n_experts} experts in host memory (picks "
                  f"{r['host_picks']}/{r['picks']}): dev {r['dev_ms']:.3f} ms, host "
                  f"{r['host_ms']:.3f} ms, split {r['split_ms']:.3f} ms, overlap "
                  f"{r['overlap']:.2f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512])
    ap.add_argument("--host-share", type=float, nargs="*", default=[0.125, 0.5])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=6)
    a = ap.parse_args(argv)
    for name, v in (("--tokens", a.tokens), ("--repeat", [a.repeat]), ("--hidden", [a.hidden]),
                    ("--inter", [a.inter]), ("--experts", [a.experts]), ("--k", [a.k])):
        if min(v) < 1:
            ap.error(f"{name} must be at least 1, got {min(v)}")
    if a.k > a.experts:
        ap.error(f"--k {a.k} is more than --experts {a.experts}")
    if not all(0.0 < s < 1.0 for s in a.host_share):
        ap.error(f"--host-share values must be in (0, 1), got {a.host_share}")
    from kernels.cuda._build import cuda_available
    if not cuda_available():
        print("bench_cuda_experts: no CUDA device", file=sys.stderr)
        return 2
    run(a.tokens, a.host_share, a.repeat, a.hidden, a.inter, a.experts, a.k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
