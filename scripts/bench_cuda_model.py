"""Decode tokens/s of a model on the GPU (workers/cuda_model.py + DevicePool) against the numpy
model on the host (workers/model.py + KVPool), in one process, as a markdown table.

    python scripts/bench_cuda_model.py [--model models/kvfleet-mini] [--slots 1 16]
                                       [--tiers f32 kv8] [--prompt 64] [--steps 64]

Per (tier, slots, backend): every slot is prefilled with its own `prompt` random tokens
(one forward per slot), WARMUP decode steps run untimed, then `steps` ragged-free decode
steps (one token per slot, greedy on the host from the returned float32 logits, as a worker
samples) are timed with the wall clock; a GPU step ends when its logits are on the host, so
the time is end to end. tokens/s = slots x steps / seconds. The last column is the largest
relative L2 error of the GPU's logits against the numpy model's on the first timed step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.pool import KVPool  # noqa: E402
from workers.model import Model  # noqa: E402

WARMUP = 4


def run(model, pool, prompts: np.ndarray, steps: int) -> tuple[float, float, np.ndarray]:
    """(prefill seconds, decode seconds, logits of the first timed step)."""
    S, P = prompts.shape
    slots = [pool.alloc_slot() for _ in range(S)]
    t0 = time.perf_counter()
    tok = np.zeros(S, np.int64)
    for i, s in enumerate(slots):
        tok[i] = model.forward(prompts[i], [s] * P, np.arange(P), pool, logits_at=[P - 1])[0].argmax()
    prefill = time.perf_counter() - t0
    pos = np.full(S, P)
    for _ in range(WARMUP):
        tok = model.forward(tok, slots, pos, pool).argmax(-1)
        pos += 1
    first = None
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.forward(tok, slots, pos, pool)
        first = logits if first is None else first
        tok = logits.argmax(-1)
        pos += 1
    return prefill, time.perf_counter() - t0, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "kvfleet-mini"))
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tiers", nargs="+", default=["f32", "kv8"])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    import cupy as cp

    from kvstore.device_pool import DevicePool
    from workers.cuda_model import CudaModel
    cpu = Model.load(a.model)
    gpu = CudaModel.load(a.model)
    cfg = cpu.config
    ctx = a.prompt + WARMUP + a.steps
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"model {a.model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads, {cfg.n_routed_experts} experts, vocab {cfg.vocab_size}")
    print(f"device {name}, CuPy {cp.__version__}, numpy {np.__version__}, "
          f"{os.cpu_count()} host cores; prompt {a.prompt}, {WARMUP} warm-up + {a.steps} timed "
          f"decode steps")
    print()
    print("| tier | slots | numpy tok/s | cuda tok/s | speed-up | numpy ms/step | cuda ms/step "
          "| numpy prefill tok/s | cuda prefill tok/s | logits rel err |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for tier in a.tiers:
        # untimed: compiles this tier's kernels (NVRTC) before anything is timed
        run(gpu, DevicePool.for_model(cfg, tier, 1, ctx), rng.integers(0, cfg.vocab_size, (1, 8)), 1)
        for S in a.slots:
            prompts = rng.integers(0, cfg.vocab_size, (S, a.prompt))
            pc, dc, lc = run(cpu, KVPool.for_model(cfg, tier, S, ctx), prompts, a.steps)
            pg, dg, lg = run(gpu, DevicePool.for_model(cfg, tier, S, ctx), prompts, a.steps)
            err = (np.linalg.norm(lg - lc, axis=-1) / np.linalg.norm(lc, axis=-1)).max()
            n = S * a.steps
            print(f"| {tier} | {S} | {n / dc:.0f} | {n / dg:.0f} | {dc / dg:.2f}x | "
                  f"{1e3 * dc / a.steps:.2f} | {1e3 * dg / a.steps:.2f} | "
                  f"{S * a.prompt / pc:.0f} | {S * a.prompt / pg:.0f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
