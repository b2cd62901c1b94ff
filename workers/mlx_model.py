"""The DeepSeek-V3-family decoder on MLX arrays, for `metal` workers (Apple silicon; the MLX
CPU backend elsewhere). It is workers/model.py's forward written with MLX ops:

    embed -> layers (MLA absorbed through the pool, dense MLP or MoE) -> norm -> lm_head

Shared with the numpy model rather than copied: the config and weights dict come from the
numpy loader (workers.weights.load_params), RoPE tables from workers.rope.Rope (cos/sin for
the step's positions, computed on the host and uploaded once per step), and MoE routing
from workers.moe.route (router logits come back to the host, [N, E] floats per layer, so
the expert choice is the numpy model's code). Weights and the KV planes are mx arrays,
the matmuls run in MLX and attention goes through kernels/metal (MLXKVPool).

`load_metal(model_dir, tier, slots, max_context)` is the factory a worker calls for kind
`metal`: it returns (model, pool) sharing one KernelStats, so the model's
`drain_fallbacks()` reports the pool's fallbacks to the worker step.
"""
from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels.metal import backend
from kernels.metal.backend import KernelStats
from kernels.metal.pool import MLXKVPool
from workers.config import ModelConfig
from workers.mla import project
from workers.model import check_batch, check_logits_at
from workers.moe import picks_by_expert, route
from workers.rope import Rope
from workers.weights import load_params

log = logging.getLogger(__name__)


def rms_norm(x: mx.array, w: mx.array, eps: float) -> mx.array:
    var = mx.mean(mx.square(x), axis=-1, keepdims=True)
    return (x / mx.sqrt(var + eps)) * w


def silu(x: mx.array) -> mx.array:
    return x * (0.5 * (1.0 + mx.tanh(0.5 * x)))  # the numpy model's overflow-free form


def gated_mlp(x: mx.array, gate: mx.array, up: mx.array, down: mx.array) -> mx.array:
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def rope_apply(x: mx.array, cos: mx.array, sin: mx.array, interleave: bool) -> mx.array:
    """Rotate x [N, ..., d] with cos/sin [N, d/2]; the layouts of workers.rope.Rope.apply."""
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
        return mx.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(x.shape)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return mx.concatenate([a * c - b * s, b * c + a * s], axis=-1)


class MLXLayer:
    def __init__(self, cfg: ModelConfig, i: int, p: dict[str, mx.array], np_bias):
        self.cfg, self.i, self.p = cfg, i, p
        self.experts = None  # routed-expert provider (workers.moe.MoE); None = all in p
        self.router_bias = np_bias  # numpy: routing runs on the host (workers.moe.route)
        nh, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        kv_b = p["kv_b"].reshape(nh, dn + dv, cfg.kv_lora_rank)
        self.w_uk = kv_b[:, :dn]                   # [H, Dn, Dl]
        self.w_uv_t = kv_b[:, dn:].transpose(0, 2, 1)  # [H, Dl, Dv]

    def attention(self, x, slots, positions, pool, cos, sin, rope: Rope) -> mx.array:
        c, p, N = self.cfg, self.p, x.shape[0]
        q, L, k_rope = project(x, p, c, rms_norm)  # workers/mla.py, on mx arrays
        q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        R = rope_apply(k_rope, cos, sin, rope.interleave)
        q_rope = rope_apply(q_rope, cos, sin, rope.interleave)
        q_lat = (q_nope.transpose(1, 0, 2) @ self.w_uk).transpose(1, 0, 2)  # [N, H, Dl]
        pool.write(self.i, slots, positions, L, R)
        ctx = pool.attend(self.i, slots, positions, q_lat, q_rope, rope.softmax_scale)
        out = (ctx.transpose(1, 0, 2) @ self.w_uv_t).transpose(1, 0, 2).reshape(N, -1)
        out = out @ p["o"].T
        return out + p["o_bias"] if "o_bias" in p else out

    def moe(self, x: mx.array) -> mx.array:
        p = self.p
        logits = x @ p["router"].T
        idx, w = route(self.cfg, np.array(logits), self.router_bias)  # host: [N, k]
        if self.experts is not None:  # expert parallel: the provider works on host arrays
            out = mx.array(self.experts.apply(self.i, np.array(x), idx, w))
            if "shared.gate" in p:
                out = out + gated_mlp(x, p["shared.gate"], p["shared.up"], p["shared.down"])
            return out
        k = idx.shape[1]
        wf = w.reshape(-1)
        out = mx.zeros_like(x)
        for e, pick in picks_by_expert(idx):  # one matmul set per used expert
            tok = mx.array((pick // k).astype(np.int32))  # a token picks an expert at most once
            y = gated_mlp(x[tok], p["experts.gate"][e], p["experts.up"][e], p["experts.down"][e])
            out = out.at[tok].add(y * mx.array(wf[pick])[:, None])
        if "shared.gate" in p:
            out = out + gated_mlp(x, p["shared.gate"], p["shared.up"], p["shared.down"])
        return out

    def __call__(self, x, slots, positions, pool, cos, sin, rope: Rope) -> mx.array:
        eps, p = self.cfg.rms_norm_eps, self.p
        h = x + self.attention(rms_norm(x, p["attn_norm"], eps), slots, positions, pool, cos, sin, rope)
        y = rms_norm(h, p["mlp_norm"], eps)
        if self.cfg.is_moe_layer(self.i):
            return h + self.moe(y)
        return h + gated_mlp(y, p["gate"], p["up"], p["down"])


class MLXModel:
    """Same interface as workers.model.Model: `config`, `forward(...) -> numpy logits`."""

    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray],
                 stats: KernelStats | None = None):
        self.config = cfg
        self.stats = stats if stats is not None else KernelStats()
        self.device = backend.device()  # Metal GPU unless absent or KVFLEET_METAL=0/COLI_METAL=0
        self.rope = Rope.from_config(cfg)
        self.embed = mx.array(params["embed"])
        self.norm = mx.array(params["norm"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else mx.array(params["lm_head"])
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            pre = f"layers.{i}."
            p = {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}
            self.layers.append(MLXLayer(cfg, i, {k: mx.array(v) for k, v in p.items()},
                                        p.get("router_bias")))
        mx.eval(self.embed, self.lm_head, [list(layer.p.values()) for layer in self.layers])

    def set_experts(self, experts) -> None:
        """Route every MoE layer's experts through `experts` (see workers.moe.MoE)."""
        for layer in self.layers:
            layer.experts = experts

    @classmethod
    def load(cls, model_dir: str | Path, stats: KernelStats | None = None,
             experts: dict[int, np.ndarray] | None = None) -> "MLXModel":
        """experts: load only these routed experts per layer (workers.weights.load_params)."""
        cfg = ModelConfig.from_file(Path(model_dir) / "config.json")
        model = cls(cfg, load_params(model_dir, cfg, experts=experts), stats)
        log.info("loaded %s on MLX (%s): %d layers, vocab %d", model_dir, mx.default_device(),
                 cfg.num_hidden_layers, cfg.vocab_size)
        return model

    def forward(self, tokens, slots, positions, pool: MLXKVPool, logits_at=None) -> np.ndarray:
        """Logits [N, vocab] (or [len(logits_at), vocab]) float32 for a flat token batch."""
        tokens, slots, positions = check_batch(tokens, slots, positions, self.config.vocab_size)
        logits_at = check_logits_at(logits_at, len(tokens))
        with mx.stream(self.device):
            cos, sin = (mx.array(a) for a in self.rope.cos_sin(positions))
            x = self.embed[mx.array(tokens.astype(np.int32))]
            for layer in self.layers:
                x = layer(x, slots, positions, pool, cos, sin, self.rope)
            if logits_at is not None:
                x = x[mx.array(logits_at.astype(np.int32))]
            x = rms_norm(x, self.norm, self.config.rms_norm_eps)
            return np.array(x @ self.lm_head.T, dtype=np.float32)

    def drain_fallbacks(self) -> dict[str, int]:
        """Fallbacks since the last call (the worker step reports them), as metal.<name>
        (workers/fallbacks.py lists every path)."""
        return {f"metal.{name}": n for name, n in self.stats.drain_fallbacks().items()}


def load_metal(model_dir: str | Path, tier: str, slots: int, max_context: int,
               block_size: int = 16, experts: dict[int, np.ndarray] | None = None
               ) -> tuple[MLXModel, MLXKVPool]:
    """The model and KV pool of a `metal` worker, sharing one KernelStats."""
    stats = KernelStats()
    model = MLXModel.load(model_dir, stats, experts=experts)
    pool = MLXKVPool.for_model(model.config, tier, slots, max_context, block_size=block_size)
    pool.stats = stats
    return model, pool
