"""Host time of the KV pool's bookkeeping in a decode step: one KVPool.write per layer call
(every slot appends one token), as the slot count grows.

    python scripts/bench_pool_step.py [--slots 64 256] [--tier f32] [--steps 100]

The rows are GLM-5 wide (kv_lora 512, rope 64); the f32 tier keeps the encode cheap, so the
figure is mostly the pool's own work (argument and position checks, the scatter). Two
figures per layer call: the best of --steps consecutive steps, which take no new block, and
the median of those steps where every slot crosses into a new block (1 in 16 here: all
slots append in lockstep; the first layer call of such a step takes the blocks).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvstore.pool import KVPool  # noqa: E402


def step_times(slots: int, tier: str, steps: int) -> tuple[float, float]:
    pool = KVPool(1, 512, 64, tier, n_blocks=slots * 8, block_size=16, max_slots=slots,
                  max_blocks_per_slot=8)
    ids = np.array([pool.alloc_slot() for _ in range(slots)])
    rng = np.random.default_rng(0)
    L = rng.standard_normal((slots, 512)).astype(np.float32)
    R = rng.standard_normal((slots, 64)).astype(np.float32)
    pos = np.zeros(slots, np.int64)
    plain, alloc = [], []
    for _ in range(min(steps, 8 * 16)):  # (the slots' 8 blocks of 16 tokens)
        t0 = time.perf_counter()
        pool.write(0, ids, pos, L, R)
        (alloc if pos[0] % 16 == 0 else plain).append(time.perf_counter() - t0)
        pos += 1
    return min(plain), float(np.median(alloc))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--tier", default="f32")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    for n in args.slots:
        best, alloc = step_times(n, args.tier, args.steps)
        print(f"{n:5d} slots, {args.tier}: {1e3 * best:.3f} ms per KVPool.write layer call "
              f"(best of {min(args.steps, 128)} steps); {1e3 * alloc:.3f} ms where every slot "
              f"takes a block (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
