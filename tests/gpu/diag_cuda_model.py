"""Diagnostic (not collected by pytest): where the CuPy model's logits leave the numpy
model's in multi-slot decode: prefill logits, the cached rows (for coded tiers the printed
"L rows" figure is a difference of code bytes, meaningful only for f32), per-step decode
errors, and attention alone on the host pool's rows copied into a DevicePool.

    python3 tests/gpu/diag_cuda_model.py     # run on the H200, see
                                             # docs/benchmarks/2026-11-30-h200-model.md"""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kvstore.device_pool import DevicePool  # noqa: E402
from kvstore.pool import KVPool  # noqa: E402
from workers.cuda_model import CudaModel  # noqa: E402
from workers.model import Model  # noqa: E402

MINI = Path(__file__).resolve().parents[2] / "models" / "kvfleet-mini"


def rel(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def case(cpu, gpu, tier, S, P, steps=4, seed=0):
    cfg = cpu.config
    rng = np.random.default_rng(seed)
    ctx = P + steps + 1
    host, dev = KVPool.for_model(cfg, tier, S, ctx), DevicePool.for_model(cfg, tier, S, ctx)
    slots = [host.alloc_slot() for _ in range(S)]
    [dev.alloc_slot() for _ in range(S)]
    prompts = rng.integers(0, cfg.vocab_size, (S, P))
    pre = []
    for i, s in enumerate(slots):
        a = cpu.forward(prompts[i], [s] * P, np.arange(P), host, logits_at=[P - 1])
        b = gpu.forward(prompts[i], [s] * P, np.arange(P), dev, logits_at=[P - 1])
        pre.append(rel(b, a).max())
    lrow = max(np.abs(dev.read_rows(s, l)[0] - host.read_rows(s, l)[0]).max()
               for s in slots for l in range(cfg.num_hidden_layers))
    pos = np.full(S, P)
    out = []
    for t in range(steps):
        tok = rng.integers(0, cfg.vocab_size, S)
        a = cpu.forward(tok, slots, pos, host)
        b = gpu.forward(tok, slots, pos, dev)
        e = rel(b, a)
        out.append(f"{e.max():.1e}@{int(e.argmax())}")
        pos += 1
    # attention alone on the host pool's rows copied into a fresh DevicePool
    iso = DevicePool.for_model(cfg, tier, S, ctx)
    [iso.alloc_slot() for _ in range(S)]
    for l in range(cfg.num_hidden_layers):
        for s in slots:
            n = host.length(s)
            iso.write_coded(l, [s] * n, np.arange(n), *host.read_rows(s, l))
    H = cfg.num_attention_heads
    ql = rng.standard_normal((S, H, cfg.kv_lora_rank)).astype(np.float32)
    qr = rng.standard_normal((S, H, cfg.qk_rope_head_dim)).astype(np.float32)
    att = []
    for l in range(cfg.num_hidden_layers):
        want = host.attend(l, slots, pos - 1, ql, qr, 0.1)
        got = iso.attend(l, slots, pos - 1, ql, qr, 0.1)
        att.append(rel(got.reshape(S, -1), want.reshape(S, -1)).max())
    print(f"{tier} S={S:2d} P={P:3d}: prefill last-logit err max {max(pre):.1e}; L rows max|d| "
          f"{lrow:.1e}; decode err per step {out}; attention alone per layer "
          f"{[f'{x:.1e}' for x in att]}", flush=True)


def main():
    cpu, gpu = Model.load(MINI), CudaModel.load(MINI)
    for S, P in ((1, 64), (2, 64), (4, 64), (16, 16), (16, 64), (16, 120)):
        case(cpu, gpu, "f32", S, P)
    case(cpu, gpu, "kv8", 16, 64)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
