"""ModelConfig: one frozen view of a DeepSeek-V3-family `config.json`.

Reads the hub's configs (`deepseek_v3`, `deepseek_v2`, `glm_moe_dsa`, `kimi_k2`, ...) with the
Hugging Face field names. RoPE comes either as the hub writes it (`rope_theta` +
`rope_scaling`) or as transformers 5 writes it (`rope_parameters`). Unknown keys are ignored;
a missing required key or an impossible value is a ConfigError naming the field and file.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a model: names the file, the field and the value."""


REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size",
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
)

# Per-family defaults for optional keys the hub configs sometimes leave out: what the
# transformers config class of the family holds (checked against transformers 5.24), so that
# a config.json gives the model transformers (and vLLM) build from it. Anything not listed
# falls back to COMMON.
# - deepseek_v3: DeepseekV3Config. Its num_nextn_predict_layers=1 is not taken, as
#   transformers never runs those layers, and a checkpoint without the key has no MTP weights.
# - kimi_k2: no class of its own: the hub's config.json maps AutoConfig to its copy of
#   DeepseekV3Config, and transformers' Kimi_K25Config reads a kimi_k2 text config as
#   deepseek_v3; so DeepseekV3Config's defaults.
# - glm_moe_dsa: GlmMoeDsaConfig (it has no rope_interleave key: its attention always
#   interleaves, as COMMON's True does; mlp_layer_types defaults to first_k_dense_replace
#   dense layers then sparse ones, which is_moe_layer computes from the same default).
# bos/eos_token_id are not taken from the classes (0 / 1): they only decide where generation
# stops, and token 1 is an ordinary token in other vocabularies (Kimi's eos is 163585).
COMMON: dict[str, Any] = {
    "q_lora_rank": None, "n_shared_experts": 1, "first_k_dense_replace": 0,
    "moe_layer_freq": 1, "routed_scaling_factor": 1.0, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "rope_interleave": True, "num_nextn_predict_layers": 0,
    "index_n_heads": 0, "index_head_dim": 0, "index_topk": 0, "tie_word_embeddings": False,
    "bos_token_id": None, "eos_token_id": None, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "attention_bias": False,
}
_DEEPSEEK_V3 = {"routed_scaling_factor": 2.5, "q_lora_rank": 1536, "n_group": 8,
                "topk_group": 4, "first_k_dense_replace": 3}
FAMILY: dict[str, dict[str, Any]] = {
    "deepseek_v3": _DEEPSEEK_V3,
    "kimi_k2": _DEEPSEEK_V3,
    "glm_moe_dsa": {"routed_scaling_factor": 2.5, "q_lora_rank": 2048, "first_k_dense_replace": 3,
                    "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
                    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048},
    "deepseek_v2": {"scoring_func": "softmax", "topk_method": "greedy", "n_shared_experts": 2,
                    "norm_topk_prob": False, "n_group": 1, "topk_group": 1},
}
SCORING = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (the only scaling the DeepSeek-V3 family ships)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # None (absent) = attention factor mscale(factor), as transformers
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # explicit cos/sin scale; None = derived from mscale
    truncate: bool = True  # round the YaRN correction range outward to whole dims


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    rope_interleave: bool
    max_position_embeddings: int
    num_nextn_predict_layers: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    mlp_layer_types: tuple[str, ...] | None = None  # "dense" / "sparse" per layer (glm_moe_dsa)
    eos_token_ids: tuple[int, ...] = field(default=())
    source: str = "<dict>"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        if self.mlp_layer_types is not None:  # GLM-MoE-DSA spells the schedule out
            return self.mlp_layer_types[i] == "sparse"
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<dict>") -> "ModelConfig":
        return _parse(d, source)


def _err(source: str, name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{source}: {name}={value!r} {why}")


def _int(d: dict, name: str, source: str, lo: int = 1, optional: bool = False) -> int | None:
    v = d.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _err(source, name, v, "must be an integer")
    if v < lo:
        raise _err(source, name, v, f"must be >= {lo}")
    return v


def _float(d: dict, name: str, source: str, positive: bool = True) -> float:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _err(source, name, v, "must be a finite number")
    if positive and v <= 0:
        raise _err(source, name, v, "must be positive")
    return float(v)


def _bool(d: dict, name: str, source: str) -> bool:
    v = d.get(name)
    if not isinstance(v, bool):  # bool("false") is True
        raise _err(source, name, v, "must be true or false")
    return v


def _choice(d: dict, name: str, source: str, allowed: tuple[str, ...]) -> str:
    v = d.get(name)
    if v not in allowed:
        raise _err(source, name, v, f"must be one of {allowed}")
    return v


def _rope(d: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, yarn scaling) from `rope_parameters` (transformers 5) or the hub keys."""
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise _err(source, "rope_parameters", params, "must be an object or null")
    if isinstance(params, dict):
        theta_src = params if "rope_theta" in params else d
        scaling = params
        where = "rope_parameters"
    else:
        theta_src, scaling, where = d, d.get("rope_scaling"), "rope_scaling"
    theta = _float({"rope_theta": theta_src.get("rope_theta", 10000.0)}, "rope_theta", source)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise _err(source, where, scaling, "must be an object or null")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise _err(source, f"{where}.rope_type", kind, "is not supported (only 'yarn' or 'default')")
    s = {k: v for k, v in scaling.items() if v is not None}
    if "original_max_position_embeddings" in s:
        orig = _int(s, "original_max_position_embeddings", f"{source} {where}")
    else:
        orig = _int(d, "max_position_embeddings", source)
    if "factor" not in s:
        s["factor"] = _int(d, "max_position_embeddings", source) / orig  # as transformers does
    af = s.get("attention_factor")
    ys = RopeScaling(
        factor=_float(s, "factor", f"{source} {where}"),
        original_max_position_embeddings=orig,
        beta_fast=_float({"beta_fast": s.get("beta_fast", 32.0)}, "beta_fast", f"{source} {where}"),
        beta_slow=_float({"beta_slow": s.get("beta_slow", 1.0)}, "beta_slow", f"{source} {where}"),
        mscale=None if "mscale" not in s else _float(s, "mscale", f"{source} {where}", positive=False),
        mscale_all_dim=_float({"mscale_all_dim": s.get("mscale_all_dim", 0.0)}, "mscale_all_dim",
                              f"{source} {where}", positive=False),
        attention_factor=None if af is None else _float(s, "attention_factor", f"{source} {where}"),
        truncate=_bool({"truncate": s.get("truncate", True)}, "truncate", f"{source} {where}"),
    )
    return theta, ys


def _eos(v: Any, source: str) -> tuple[int, ...]:
    if v is None:
        return ()
    items = v if isinstance(v, list) else [v]
    if not items or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items):
        raise _err(source, "eos_token_id", v, "must be a non-negative int or a non-empty list of them")
    return tuple(items)


def _layer_types(v: Any, n_layers: Any, source: str) -> tuple[str, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != n_layers or any(t not in ("dense", "sparse") for t in v):
        raise _err(source, "mlp_layer_types", v,
                   f"must list 'dense' or 'sparse' for each of the {n_layers} layers")
    return tuple(v)


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    model_type = raw.get("model_type", "deepseek_v3")
    if not isinstance(model_type, str):
        raise _err(source, "model_type", model_type, "must be a string")
    for name in REQUIRED:
        if raw.get(name) is None:
            raise ConfigError(f"{source}: missing required field {name!r} (model_type {model_type!r})")
    # (null is "absent" except where transformers gives it a meaning: q_lora_rank null = no
    # query LoRA, n_shared_experts null = no shared experts, as DeepseekV2 reads it)
    d = {**COMMON, **FAMILY.get(model_type, {}),
         **{k: v for k, v in raw.items() if v is not None or k == "q_lora_rank"}}
    if "n_shared_experts" in raw and raw["n_shared_experts"] is None:
        d["n_shared_experts"] = 0
    n_layers = _int(d, "num_hidden_layers", source)
    if raw.get("first_k_dense_replace") is None:
        # a family default past the last layer (a config with fewer layers than it): transformers
        # keeps the default and builds every layer dense (no layer_idx >= it); the same model
        d["first_k_dense_replace"] = min(d["first_k_dense_replace"], n_layers)
    theta, scaling = _rope(d, source)
    cfg = ModelConfig(
        model_type=str(model_type),
        vocab_size=_int(d, "vocab_size", source),
        hidden_size=_int(d, "hidden_size", source),
        num_hidden_layers=n_layers,
        num_attention_heads=_int(d, "num_attention_heads", source),
        q_lora_rank=_int(d, "q_lora_rank", source, optional=True),
        kv_lora_rank=_int(d, "kv_lora_rank", source),
        qk_nope_head_dim=_int(d, "qk_nope_head_dim", source),
        qk_rope_head_dim=_int(d, "qk_rope_head_dim", source),
        v_head_dim=_int(d, "v_head_dim", source),
        intermediate_size=_int(d, "intermediate_size", source),
        n_routed_experts=_int(d, "n_routed_experts", source),
        num_experts_per_tok=_int(d, "num_experts_per_tok", source),
        n_shared_experts=_int(d, "n_shared_experts", source, lo=0),
        moe_intermediate_size=_int(d, "moe_intermediate_size", source),
        first_k_dense_replace=_int(d, "first_k_dense_replace", source, lo=0),
        moe_layer_freq=_int(d, "moe_layer_freq", source),
        routed_scaling_factor=_float(d, "routed_scaling_factor", source),
        scoring_func=_choice(d, "scoring_func", source, SCORING),
        topk_method=_choice(d, "topk_method", source, TOPK_METHODS),
        n_group=_int(d, "n_group", source),
        topk_group=_int(d, "topk_group", source),
        norm_topk_prob=_bool(d, "norm_topk_prob", source),
        rms_norm_eps=_float(d, "rms_norm_eps", source),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=_bool(d, "rope_interleave", source),
        max_position_embeddings=_int(d, "max_position_embeddings", source),
        num_nextn_predict_layers=_int(d, "num_nextn_predict_layers", source, lo=0),
        index_n_heads=_int(d, "index_n_heads", source, lo=0),
        index_head_dim=_int(d, "index_head_dim", source, lo=0),
        index_topk=_int(d, "index_topk", source, lo=0),
        tie_word_embeddings=_bool(d, "tie_word_embeddings", source),
        attention_bias=_bool(d, "attention_bias", source),
        bos_token_id=_int(d, "bos_token_id", source, lo=0, optional=True),
        eos_token_ids=_eos(d.get("eos_token_id"), source),
        mlp_layer_types=_layer_types(d.get("mlp_layer_types"), d.get("num_hidden_layers"), source),
        source=source,
    )
    _check(cfg)
    return cfg


def _check(c: ModelConfig) -> None:
    s = c.source
    if c.num_experts_per_tok > c.n_routed_experts:
        raise _err(s, "num_experts_per_tok", c.num_experts_per_tok,
                   f"exceeds n_routed_experts={c.n_routed_experts}")
    if c.n_routed_experts % c.n_group:
        raise _err(s, "n_routed_experts", c.n_routed_experts, f"is not divisible by n_group={c.n_group}")
    if c.topk_group > c.n_group:
        raise _err(s, "topk_group", c.topk_group, f"exceeds n_group={c.n_group}")
    if c.topk_method != "greedy" and c.n_group > 1:
        per_group = c.n_routed_experts // c.n_group
        if c.topk_group * per_group < c.num_experts_per_tok:
            raise _err(s, "topk_group", c.topk_group,
                       f"keeps {c.topk_group * per_group} experts, fewer than num_experts_per_tok={c.num_experts_per_tok}")
        if c.topk_method == "noaux_tc" and per_group < 2:
            raise _err(s, "n_group", c.n_group, "leaves fewer than 2 experts per group (noaux_tc scores groups by top-2)")
    if c.qk_rope_head_dim % 2:
        raise _err(s, "qk_rope_head_dim", c.qk_rope_head_dim, "must be even")
    if c.first_k_dense_replace > c.num_hidden_layers:
        raise _err(s, "first_k_dense_replace", c.first_k_dense_replace,
                   f"exceeds num_hidden_layers={c.num_hidden_layers}")
    if any(e >= c.vocab_size for e in c.eos_token_ids):
        raise _err(s, "eos_token_id", list(c.eos_token_ids), f"must be < vocab_size={c.vocab_size}")
