"""Which model a saved KV cache belongs to, and the load rules shared by both disk formats.

A cache file (Arrow or the C engine's `.coli_kv`) names the model by six numbers, the
`.coli_kv` header words h[0..5]: layers, kv_lora, rope, index_hd (0 without DSA),
n_indexer_layers, vocab. Its format version (1 f32, 2 kv8, 3 tq/polar) and tag
(kernels/tiers.py Tier.tag) say how the rows are coded.

`plan_load` turns (file header, running model, running tier) into one decision:

    load     same model, same tier                      -> records as stored
    upgrade  v1 (f32) file, quantized tier              -> quantized in memory; the file is
                                                           left intact and rewritten in the
                                                           new format at the next save
    reject   other model, or v2/v3 under another tier,  -> clean start with a message saying
             or v3 with other codec/bits, or a header      why and what to do; the file is
             that names no known tier                      replaced only by the next save
"""
from __future__ import annotations

from dataclasses import astuple, dataclass

from kernels.tiers import CODEC_TQ, Tier, TierError, get_tier, tier_from_tag

FIELDS = ("n_layers", "kv_lora", "rope", "index_hd", "n_indexer_layers", "vocab")


@dataclass(frozen=True)
class Fingerprint:
    n_layers: int
    kv_lora: int
    rope: int
    index_hd: int = 0
    n_indexer_layers: int = 0
    vocab: int = 0

    def __post_init__(self) -> None:
        for name, v in zip(FIELDS, astuple(self)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"KV fingerprint: {name}={v!r} must be a non-negative int")
        for name in ("n_layers", "kv_lora", "rope"):
            if getattr(self, name) == 0:
                raise ValueError(f"KV fingerprint: {name}=0 must be positive")
        if (self.index_hd == 0) != (self.n_indexer_layers == 0):
            raise ValueError(f"KV fingerprint: index_hd={self.index_hd} and n_indexer_layers="
                             f"{self.n_indexer_layers} must both be 0 (no DSA) or both positive")

    @classmethod
    def from_config(cls, cfg, n_layers: int | None = None) -> "Fingerprint":
        """From a workers.config.ModelConfig (HF field names). n_layers overrides the count
        of cached layers (e.g. when an MTP layer is cached too)."""
        index_hd = cfg.index_head_dim if getattr(cfg, "index_n_heads", 0) else 0
        layers = cfg.num_hidden_layers if n_layers is None else n_layers
        return cls(layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, index_hd,
                   layers if index_hd else 0, cfg.vocab_size)

    @classmethod
    def from_words(cls, words, source: str) -> "Fingerprint":
        """From header words h[0..5]; a bad value (also a float, bool or string: no int()
        here, it would turn 2.9 into 2) is a HeaderError naming `source` and the field."""
        words = list(words)
        try:
            return cls(*words)
        except (ValueError, TypeError) as e:
            raise HeaderError(f"{source}: impossible header numbers {list(words)} ({e})") from None

    def words(self) -> tuple[int, ...]:
        return astuple(self)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in zip(FIELDS, astuple(self)))


class HeaderError(ValueError):
    """A file that is not a KV cache, or whose header cannot be true. Names the file."""


@dataclass(frozen=True)
class LoadPlan:
    action: str  # "load" | "upgrade" | "reject"
    file_tier: Tier | None  # None when the header names no known tier
    message: str | None  # why (for upgrade/reject), for the log and the user


def tier_label(tier: Tier) -> str:
    if tier.version == 3:
        codec = "rotated int4" if tier.codec == CODEC_TQ else "PolarQuant"
        return f"{tier.name} (v3, codec {tier.codec} {codec}, {tier.bits}-bit)"
    return f"{tier.name} (v{tier.version})"


def plan_load(path: str, version: int, tag: int, file_fp: Fingerprint,
              model_fp: Fingerprint, tier: Tier | str) -> LoadPlan:
    """Decide what to do with a cache file written as (version, tag, file_fp)."""
    tier = get_tier(tier)
    try:
        file_tier = tier_from_tag(version, tag)
    except TierError as e:
        return LoadPlan("reject", None, f"{path}: ignored ({e}); starting clean; the next save "
                                        f"replaces it")
    if file_fp != model_fp:
        return LoadPlan("reject", file_tier,
                        f"{path}: ignored: different model or version (file: {file_fp.describe()}; "
                        f"model: {model_fp.describe()}); starting clean; the next save replaces it")
    if file_tier == tier:
        return LoadPlan("load", file_tier, None)
    if file_tier.kind == "f32":
        return LoadPlan("upgrade", file_tier,
                        f"{path}: f32 cache (v1) quantized to {tier.name} on load; the file is "
                        f"rewritten as {tier_label(tier)} at the next save")
    if file_tier.version == 2:
        how = "set KV8=1 (or --kv kv8) to resume it"
    elif file_tier.kind == "tq":
        how = f"set KV_TQ={file_tier.bits} (or --kv {file_tier.name}) to resume it"
    else:
        how = (f"set KV_TQ={file_tier.bits} KV_TQ_POLAR=1 (or --kv {file_tier.name}) "
               f"to resume it")
    return LoadPlan("reject", file_tier,
                    f"{path}: ignored: written as {tier_label(file_tier)} but running "
                    f"{tier_label(tier)}; {how}; starting clean; the next save replaces it")
