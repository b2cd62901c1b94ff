"""The DeepSeek-V3-family decoder on float32 numpy: embed -> layers (MLA + dense MLP or MoE)
-> final norm -> lm_head (or the tied embedding).

`Model.forward` takes a FLAT token batch: tokens[N], slots[N], positions[N]. One call may
hold a prefill chunk of one slot (positions p0..p0+n-1) or one decode token for each of many
slots at different positions, or any mix. Every layer writes its L/R rows to the pool first
and then attends through it, so prefill and decode read the same (possibly quantized) cache.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from workers.config import ModelConfig
from workers.mla import MLA
from workers.moe import MoE, gated_mlp
from workers.norm import rms_norm
from workers.rope import Rope
from workers.weights import load_params

log = logging.getLogger(__name__)


class BatchError(ValueError):
    """A forward batch (tokens, slots, positions, logits_at) that cannot be run as given."""


def _integers(values, what: str, kind: str = "integer ids") -> np.ndarray:
    """values as int64 [N]; BatchError for anything that is not already integers: np.int64
    casts truncate 3.5 to 3, read True as 1 and wrap uint64 past 2^63 (torch's embedding
    refuses float indices for the same reason, even integral ones such as 3.0)."""
    a = np.asarray(values)
    if a.size == 0:
        return np.zeros(0, np.int64)
    name = a.dtype.name
    if a.dtype.kind in "iu" and isinstance(values, (list, tuple)) and any(
            isinstance(v, (bool, np.bool_)) for v in values):
        name = "bool"  # a bool among ints ([True, 5]) reads as int64
    if name == "bool" or a.dtype.kind not in "iu" or (
            a.dtype.kind == "u" and int(a.max()) > np.iinfo(np.int64).max):
        raise BatchError(f"{what} must be {kind} (int64 values), got {name} values "
                         f"{a.reshape(-1)[:5].tolist()}")
    return a.astype(np.int64).reshape(-1)


def check_batch(tokens, slots, positions, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A flat forward batch as int64 arrays [N]; BatchError naming the bad values. Shared by
    the numpy, MLX and CUDA models."""
    tokens = _integers(tokens, "tokens")
    slots = _integers(slots, "slots")
    positions = _integers(positions, "positions")
    if not (len(tokens) == len(slots) == len(positions)) or len(tokens) == 0:
        raise BatchError(f"tokens, slots, positions must be equal non-empty lengths, got "
                         f"{len(tokens)}, {len(slots)}, {len(positions)}")
    if tokens.min() < 0 or tokens.max() >= vocab:
        bad = tokens[(tokens < 0) | (tokens >= vocab)][:5].tolist()
        raise BatchError(f"token ids {bad} are outside the vocabulary [0, {vocab})")
    if positions.min() < 0:
        raise BatchError(f"negative positions {positions[positions < 0][:5].tolist()}")
    return tokens, slots, positions


def check_logits_at(logits_at, n: int) -> np.ndarray | None:
    """The rows of an n-token batch whose logits to return, as int64, or None for all rows.
    Checked before any layer runs (a row past the end was an IndexError after every layer
    had written its KV; a negative one silently counted from the end)."""
    if logits_at is None:
        return None
    if np.ndim(logits_at) != 1:
        raise BatchError(f"logits_at must be one-dimensional, got shape {np.shape(logits_at)}")
    at = _integers(logits_at, "logits_at", "integer row indices")
    if at.size and (at.min() < 0 or at.max() >= n):
        bad = at[(at < 0) | (at >= n)][:5].tolist()
        raise BatchError(f"logits_at {bad} must index the batch's {n} rows (0..{n - 1})")
    return at


class Layer:
    def __init__(self, cfg: ModelConfig, i: int, p: dict[str, np.ndarray], rope: Rope):
        self.i, self.cfg, self.p = i, cfg, p
        self.attn = MLA(cfg, p, rope)
        self.moe = MoE(cfg, p, i) if cfg.is_moe_layer(i) else None

    def __call__(self, x, slots, positions, pool, cos, sin):
        eps = self.cfg.rms_norm_eps
        h = x + self.attn(rms_norm(x, self.p["attn_norm"], eps), self.i, slots, positions, pool, cos, sin)
        y = rms_norm(h, self.p["mlp_norm"], eps)
        mlp = self.moe(y) if self.moe else gated_mlp(y, self.p["gate"], self.p["up"], self.p["down"])
        return h + mlp


class Model:
    def __init__(self, cfg: ModelConfig, params: dict[str, np.ndarray]):
        self.config = cfg
        self.rope = Rope.from_config(cfg)
        self.embed = params["embed"]
        self.norm = params["norm"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else params["lm_head"]
        self.dense_past_topk = False  # a DSA model attended densely past index_topk (said once)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            pre = f"layers.{i}."
            p = {k[len(pre):]: v for k, v in params.items() if k.startswith(pre)}
            self.layers.append(Layer(cfg, i, p, self.rope))

    def set_experts(self, experts) -> None:
        """Route every MoE layer's experts through `experts` (see workers.moe.MoE)."""
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.experts = experts

    @classmethod
    def load(cls, model_dir: str | Path) -> "Model":
        cfg = ModelConfig.from_file(Path(model_dir) / "config.json")
        model = cls(cfg, load_params(model_dir, cfg))
        log.info("loaded %s: %d layers, hidden %d, %d experts, vocab %d", model_dir,
                 cfg.num_hidden_layers, cfg.hidden_size, cfg.n_routed_experts, cfg.vocab_size)
        return model

    def forward(self, tokens, slots, positions, pool, logits_at=None) -> np.ndarray:
        """Logits [N, vocab] (or [len(logits_at), vocab]) f32 for a flat batch of tokens."""
        tokens, slots, positions = check_batch(tokens, slots, positions, self.config.vocab_size)
        logits_at = check_logits_at(logits_at, len(tokens))
        self._note_dense_dsa(positions)
        x = self.embed[tokens]
        cos, sin = self.rope.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, slots, positions, pool, cos, sin)
        if logits_at is not None:
            x = x[logits_at]
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return (x @ self.lm_head.T).astype(np.float32, copy=False)

    def _note_dense_dsa(self, positions: np.ndarray) -> None:
        """DSA (the index_* sparse attention of GLM-5) is not built yet: attention is dense,
        which equals DSA while a context holds at most index_topk tokens. Say so once when a
        context grows past it."""
        topk = self.config.index_topk
        if topk and not self.dense_past_topk and int(positions.max()) + 1 > topk:
            self.dense_past_topk = True
            log.warning("context of %d tokens is past index_topk=%d: kvfleet attends densely "
                        "(DSA sparse selection is not implemented), so logits differ from DSA",
                        int(positions.max()) + 1, topk)
