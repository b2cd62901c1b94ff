"""Decode tokens/s of a model on the GPU (workers/cuda_model.py + DevicePool) against the numpy
model on the host (workers/model.py + KVPool), in one process, as markdown tables.

    python scripts/bench_cuda_model.py [--model models/kvfleet-mini] [--slots 1 16]
                                       [--tiers f32 kv8] [--prompt 64] [--steps 64] [--no-wide]

Two models: the checkpoint given by --model (default: the shipped kvfleet-mini), and unless
--no-wide a "wide" one with random weights built in memory from scripts/make_tiny_model.py's
generator (WIDE below: GLM-5's latent widths, 16 heads, hidden 2048, 16 experts of 1024, 4
layers), where the matmuls are big enough for the GPU to matter.

Per (tier, slots, backend): every slot is prefilled with its own `prompt` random tokens (one
forward per slot), WARMUP decode steps run untimed, then `steps` decode steps (one token per
slot, logits of every row to the host and an argmax there, as a worker samples) are timed
with the wall clock; a GPU step ends when its logits are on the host, so the time is end to
end. The decoded tokens are a fixed random sequence (teacher forcing), the same for both
backends, so the last column (largest relative L2 error of the GPU's logits against the
numpy model's over the timed steps) compares like with like. tokens/s = slots x steps / s.
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
from workers.config import ModelConfig  # noqa: E402
from workers.model import Model  # noqa: E402
from workers.weights import name_table  # noqa: E402

WARMUP = 4
WIDE = dict(hidden_size=2048, intermediate_size=4096, moe_intermediate_size=1024,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
            n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=768, qk_nope_head_dim=128,
            v_head_dim=128, vocab_size=16384, max_position_embeddings=4096)


def wide_params() -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """WIDE config and random float32 parameters (kvfleet keys, experts stacked)."""
    import scripts.make_tiny_model as maker  # ROOT is on sys.path
    cfg = ModelConfig.from_dict({**maker.base_config(set()), **WIDE}, source="bench WIDE")
    tensors = maker.random_tensors(cfg, 0)
    params: dict[str, np.ndarray] = {}
    for name, slot in name_table(cfg).items():
        if slot.index is None:
            params[slot.param] = tensors.pop(name)
        else:
            params.setdefault(slot.param, np.empty((slot.stack, *slot.shape), np.float32))
            params[slot.param][slot.index] = tensors.pop(name)
    return cfg, params


def run(model, pool, prompts: np.ndarray, feed: np.ndarray):
    """(prefill s, decode s, logits [steps, S, V] of the timed steps); feed [WARMUP + steps, S]."""
    S, P = prompts.shape
    slots = [pool.alloc_slot() for _ in range(S)]
    t0 = time.perf_counter()
    for i, s in enumerate(slots):
        model.forward(prompts[i], [s] * P, np.arange(P), pool, logits_at=[P - 1])[0].argmax()
    prefill = time.perf_counter() - t0
    pos = np.full(S, P)
    for tok in feed[:WARMUP]:
        model.forward(tok, slots, pos, pool).argmax(-1)
        pos += 1
    out = []
    t0 = time.perf_counter()
    for tok in feed[WARMUP:]:
        logits = model.forward(tok, slots, pos, pool)
        logits.argmax(-1)
        out.append(logits)
        pos += 1
    return prefill, time.perf_counter() - t0, np.array(out)


def pool_cost(pool_cls, cfg, tier: str, S: int, ctx: int, reps: int = 20) -> tuple[float, float]:
    """Microseconds per layer call of DevicePool.write and .attend (S slots at position ctx-1,
    host wall clock with a device sync), to show how much of a step the pool takes."""
    import cupy as cp
    pool = pool_cls.for_model(cfg, tier, S, ctx)
    slots = np.array([pool.alloc_slot() for _ in range(S)])
    pos = np.full(S, ctx - 1)
    rng = cp.random.default_rng(0)
    H, dl, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    # every slot's rows 0..ctx-1 written once first: the timed write then rewrites the last
    # row, and the attend reads written rows (pools refuse gaps and unwritten positions)
    pool.write(0, np.repeat(slots, ctx), np.tile(np.arange(ctx), S),
               rng.standard_normal((S * ctx, dl), dtype=cp.float32),
               rng.standard_normal((S * ctx, dr), dtype=cp.float32))
    L, R = rng.standard_normal((S, dl), dtype=cp.float32), rng.standard_normal((S, dr), dtype=cp.float32)
    ql, qr = rng.standard_normal((S, H, dl), dtype=cp.float32), rng.standard_normal((S, H, dr), dtype=cp.float32)
    out = []
    for fn in (lambda: pool.write(0, slots, pos, L, R),
               lambda: pool.attend(0, slots, pos, ql, qr, 0.1)):
        fn()
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        cp.cuda.Device().synchronize()
        out.append(1e6 * (time.perf_counter() - t0) / reps)
    return out[0], out[1]


def table(title: str, cpu, gpu, a) -> None:
    import cupy as cp

    from kvstore.device_pool import DevicePool
    cfg = cpu.config
    ctx = a.prompt + WARMUP + a.steps
    print(f"\n### {title}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads, {cfg.n_routed_experts} experts (top "
          f"{cfg.num_experts_per_tok}) of {cfg.moe_intermediate_size}, vocab {cfg.vocab_size}\n")
    print("| tier | slots | numpy tok/s | cuda tok/s | speed-up | numpy ms/step | cuda ms/step "
          "| numpy prefill tok/s | cuda prefill tok/s | logits rel err | cuda pool write / attend us per layer |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for tier in a.tiers:
        # untimed: compiles this tier's kernels (NVRTC) before anything is timed
        run(gpu, DevicePool.for_model(cfg, tier, 1, ctx), rng.integers(0, cfg.vocab_size, (1, 8)),
            rng.integers(0, cfg.vocab_size, (WARMUP + 1, 1)))
        for S in a.slots:
            prompts = rng.integers(0, cfg.vocab_size, (S, a.prompt))
            feed = rng.integers(0, cfg.vocab_size, (WARMUP + a.steps, S))
            pc, dc, lc = run(cpu, KVPool.for_model(cfg, tier, S, ctx), prompts, feed)
            pg, dg, lg = run(gpu, DevicePool.for_model(cfg, tier, S, ctx), prompts, feed)
            err = (np.linalg.norm(lg - lc, axis=-1) / np.linalg.norm(lc, axis=-1)).max()
            w_us, a_us = pool_cost(DevicePool, cfg, tier, S, ctx)
            n = S * a.steps
            print(f"| {tier} | {S} | {n / dc:.0f} | {n / dg:.0f} | {dc / dg:.2f}x | "
                  f"{1e3 * dc / a.steps:.2f} | {1e3 * dg / a.steps:.2f} | "
                  f"{S * a.prompt / pc:.0f} | {S * a.prompt / pg:.0f} | {err:.1e} | "
                  f"{w_us:.0f} / {a_us:.0f} |", flush=True)
    cp.get_default_memory_pool().free_all_blocks()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "kvfleet-mini"))
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tiers", nargs="+", default=["f32", "kv8"])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--no-wide", action="store_true", help="skip the random wide model")
    a = ap.parse_args()
    import cupy as cp

    from workers.cuda_model import CudaModel
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"device {name}, CuPy {cp.__version__}, numpy {np.__version__}, {os.cpu_count()} host "
          f"cores; prompt {a.prompt} tokens per slot, {WARMUP} warm-up + {a.steps} timed decode steps")
    table(Path(a.model).name, Model.load(a.model), CudaModel.load(a.model), a)
    if not a.no_wide:
        cfg, params = wide_params()
        table("wide (random weights)", Model(cfg, params), CudaModel(cfg, params), a)


if __name__ == "__main__":
    main()
