"""How many bytes an MLA mixture-of-experts model needs: weights by part, KV per token.

Counts follow the Hugging Face checkpoint layout of the DeepSeek-V3 family, weight
matrices [out, in]. Checked against published checkpoints: the GLM-5.1 weight listing has
753,864,139,008 parameters and the GLM-5.2 checkpoint 1,506,659,919,872 tensor bytes; both
come out exactly (tests/cluster/test_planner.py).

- Dense weights = everything but the routed experts, in bf16: embeddings, lm_head (unless
  tied), final norm, and per cached layer (the MTP layers included) attention (q_a/q_b or
  q_proj, kv_a, kv_b, o_proj and their norms), the DSA indexer where the layer owns one
  (wq_b, wk, k_norm weight+bias, weights_proj), the dense MLP or the shared experts, the
  router (gate weight bf16, e_score_correction_bias f32 under noaux_tc), and each MTP
  layer's eh_proj, enorm, hnorm and shared_head.norm. An MTP layer shares embed_tokens and
  lm_head with the main model, so copies of them in a checkpoint are not counted.
- Routed experts: gate_proj and up_proj [moe_intermediate, hidden], down_proj
  [hidden, moe_intermediate], in one of the WEIGHT_FORMATS below; `run_experts` counts
  those of the main layers only, the ones a kvfleet job loads (it runs no MTP layer).
- KV: per cached layer and token, Tier.token_bytes(kv_lora_rank, qk_rope_head_dim) from
  kernels/tiers.py; cached layers = num_hidden_layers + num_nextn_predict_layers.
- DSA indexer keys: index_head_dim float32 per token per layer that owns an indexer.
  GLM-5.2's IndexShare gives 21 of 78 main layers an indexer (0, 1, 2, 6, 10, ..., 74,
  from `indexer_types` or `index_topk_freq`/`index_skip_topk_offset`); MTP layers always
  own one. These rows are counted apart from the KV pool (index_pool_bytes).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.tiers import Tier, get_tier
from workers.config import ConfigError, ModelConfig

BF16 = 2


@dataclass(frozen=True)
class WeightFormat:
    """Storage of one routed-expert matrix: `bits` per weight plus one scale per block."""
    name: str
    bits: int
    block: tuple[int, int] | None  # (rows, cols) covered by one scale; None = no scales
    scale_bytes: int

    def matrix_bytes(self, rows: int, cols: int) -> int:
        codes = rows * cols * self.bits
        if codes % 8:
            raise ValueError(f"{self.name}: a [{rows}, {cols}] matrix is not whole bytes")
        scales = 0
        if self.block is not None:
            br, bc = self.block
            scales = math.ceil(rows / br) * math.ceil(cols / bc) * self.scale_bytes
        return codes // 8 + scales


# bf16: the checkpoint dtype. fp8: e4m3 with one float32 scale per 128x128 block (the
# DeepSeek-V3 `weight_scale_inv` layout). int4: symmetric 4-bit with one bf16 scale per
# group of 32 inputs along a row (Kimi-K2-Thinking's compressed-tensors layout): 0.5625 B.
WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 16, None, 0),
    "fp8": WeightFormat("fp8", 8, (128, 128), 4),
    "int4": WeightFormat("int4", 4, (1, 32), 2),
}


def get_format(name: str | WeightFormat) -> WeightFormat:
    if isinstance(name, WeightFormat):
        return name
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown expert weight format {name!r}; choose one of {sorted(WEIGHT_FORMATS)}") from None


def indexer_layers(cfg: ModelConfig, raw: dict[str, Any] | None = None) -> tuple[int, ...]:
    """Cached-layer indices that own a DSA indexer (empty without index_* fields)."""
    if not (cfg.index_n_heads and cfg.index_head_dim):
        return ()
    raw = raw or {}
    n, mtp = cfg.num_hidden_layers, range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    types = raw.get("indexer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n or not set(types) <= {"full", "shared"}:
            raise ConfigError(f"{cfg.source}: indexer_types must list 'full'/'shared' for each of "
                              f"num_hidden_layers={n} layers, got {types!r:.80}")
        main = [i for i, t in enumerate(types) if t == "full"]
    elif (raw.get("index_topk_freq") or 1) > 1:
        freq, skip = int(raw["index_topk_freq"]), int(raw.get("index_skip_topk_offset") or 0)
        main = [i for i in range(n) if i < skip or (i - skip + 1) % freq == 0]
    else:
        main = list(range(n))
    return (*main, *mtp)


@dataclass(frozen=True)
class Footprint:
    """Byte counts of one model; `from_file` reads a config.json (or a model folder)."""
    config: ModelConfig
    indexer_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> "Footprint":
        cfg = ModelConfig.from_dict(raw, source=source)
        return cls(cfg, indexer_layers(cfg, raw))

    @classmethod
    def from_file(cls, path: str | Path) -> "Footprint":
        path = Path(path)
        cfg = ModelConfig.from_file(path)  # raises ConfigError naming the file
        raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
        return cls(cfg, indexer_layers(cfg, raw))

    # --- layers -------------------------------------------------------------------
    @property
    def cached_layers(self) -> int:
        return self.config.num_hidden_layers + self.config.num_nextn_predict_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Cached layers with routed experts. An MTP layer has the MLP kind of the last main
        layer (MoE in DeepSeek-V3, GLM-5 and their checkpoints' layer 61 / 78)."""
        n = self.config.num_hidden_layers
        mtp_moe = self.config.is_moe_layer(n - 1)
        return tuple(i for i in range(self.cached_layers) if (self.config.is_moe_layer(i) if i < n else mtp_moe))

    @property
    def routed_experts(self) -> int:
        return len(self.moe_layers) * self.config.n_routed_experts

    @property
    def run_moe_layers(self) -> tuple[int, ...]:
        """The MoE layers whose routed experts a kvfleet job loads, so the ones the planner
        places and pins: the main layers. It runs no MTP layer (workers/weights.py skips
        their tensors), so the MTP layers' experts count in the checkpoint (param_count) but
        would only take room from experts that run."""
        return tuple(i for i in self.moe_layers if i < self.config.num_hidden_layers)

    @property
    def run_experts(self) -> int:
        return len(self.run_moe_layers) * self.config.n_routed_experts

    # --- weights ------------------------------------------------------------------
    def dense_parts(self) -> dict[str, int]:
        """Bytes of every non-routed-expert weight, by part (bf16; the router bias f32)."""
        c = self.config
        h, heads = c.hidden_size, c.num_attention_heads
        q_in = c.q_lora_rank or h
        q = (c.q_lora_rank * h + c.q_lora_rank if c.q_lora_rank else 0) + heads * c.qk_head_dim * q_in
        kv = (c.kv_lora_rank + c.qk_rope_head_dim) * h + c.kv_lora_rank
        kv += heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank
        attn = q + kv + h * heads * c.v_head_dim + 2 * h  # + o_proj, input/post norms
        ih, inh = c.index_head_dim, c.index_n_heads
        indexer = inh * ih * q_in + ih * h + 2 * ih + inh * h
        moe = self.moe_layers
        dense_mlp = (self.cached_layers - len(moe)) * 3 * h * c.intermediate_size
        shared = len(moe) * c.n_shared_experts * 3 * h * c.moe_intermediate_size
        bias = 4 * c.n_routed_experts if c.topk_method == "noaux_tc" else 0
        nextn = c.num_nextn_predict_layers
        return {
            "embed_tokens": BF16 * c.vocab_size * h,
            "lm_head": 0 if c.tie_word_embeddings else BF16 * c.vocab_size * h,
            "final_norm": BF16 * h,
            "attention": BF16 * attn * self.cached_layers,
            "indexer": BF16 * indexer * len(self.indexer_layers),
            "dense_mlp": BF16 * dense_mlp,
            "shared_experts": BF16 * shared,
            "router": len(moe) * (BF16 * c.n_routed_experts * h + bias),
            "mtp": BF16 * nextn * (2 * h * h + 3 * h),
        }

    @property
    def dense_bytes(self) -> int:
        return sum(self.dense_parts().values())

    def expert_bytes(self, fmt: str | WeightFormat) -> int:
        """Bytes of one routed expert (gate, up, down) with its scales."""
        f, c = get_format(fmt), self.config
        return 2 * f.matrix_bytes(c.moe_intermediate_size, c.hidden_size) + f.matrix_bytes(
            c.hidden_size, c.moe_intermediate_size)

    def param_count(self) -> int:
        """All weights as stored in a bf16 checkpoint (the router bias counted once, as f32 is)."""
        c = self.config
        parts = self.dense_parts()
        bias_bytes = parts["router"] - len(self.moe_layers) * BF16 * c.n_routed_experts * c.hidden_size
        dense = (sum(parts.values()) - bias_bytes) // BF16 + bias_bytes // 4
        return dense + self.routed_experts * 3 * c.hidden_size * c.moe_intermediate_size

    # --- KV -----------------------------------------------------------------------
    def kv_token_bytes(self, tier: str | Tier) -> int:
        """KV bytes per token per cached layer."""
        return get_tier(tier).token_bytes(self.config.kv_lora_rank, self.config.qk_rope_head_dim)

    def tier_error(self, tier: str | Tier) -> str | None:
        """Why the KV pool refuses `tier` at this model's widths (tq4 and polar need
        power-of-two ones), or None when it takes it: Tier.width_error."""
        return get_tier(tier).width_error(self.config.kv_lora_rank, self.config.qk_rope_head_dim)

    def kv_bytes_per_token(self, tier: str | Tier) -> int:
        """KV bytes per token over all cached layers (MTP included)."""
        return self.cached_layers * self.kv_token_bytes(tier)

    def run_kv_bytes_per_token(self, tier: str | Tier) -> int:
        """KV bytes per token of a kvfleet job's pool (kvstore KVPool.for_model, DevicePool:
        its bytes_per_token): the main layers' (it runs no MTP layer)."""
        return self.config.num_hidden_layers * self.kv_token_bytes(tier)

    @property
    def index_bytes_per_token(self) -> int:
        return 4 * self.config.index_head_dim * len(self.indexer_layers)

    def kv_pool_bytes(self, tier: str | Tier, slots: int, ctx: int) -> int:
        return slots * ctx * self.kv_bytes_per_token(tier)

    def index_pool_bytes(self, slots: int, ctx: int) -> int:
        return slots * ctx * self.index_bytes_per_token
