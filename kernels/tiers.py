"""The KV tier table: one place that says how each tier lays out a cached row.

Every backend (numpy, CUDA, MLX), the paged pool, the on-disk formats and the planner
read this table; nothing else hard-codes a row size.

Per token and layer the cache holds two rows, L (kv_lora_rank wide) and R
(qk_rope_head_dim wide). Each row is stored as `row_bytes(n)` code bytes plus one float32
scale (fp8: amax/448; tq/polar: the row's L2 radius; f32 rows carry no scale on disk but
the pool keeps a scale plane of ones so that every tier has the same planes).

    tier     codes per row                             scale    on disk (.coli_kv / Arrow)
    f32      n float32 (4n bytes)                       none     v1, tag 0
    kv8      n bytes, OCP fp8 e4m3fn                    f32      v2, tag 1
    tq4      n/2 bytes, int4 Lloyd-Max, low nibble =    f32      v3, tag 1<<8 | 4  (codec 1)
             even index
    polarB   ceil(((n/2)B + (n/2-1)max(1,B-1))/8)       f32      v3, tag 0<<8 | B  (codec 0)
             bytes, LSB-first bit stream

Per token per layer at GLM-5 widths (L 512, R 64): f32 2304, kv8 584, tq4 296,
polar2..6 116 / 188 / 260 / 332 / 404 bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kernels.cpu.rotation import rotatable

# Codec ids of the C engine's COLIKV3 header tag (h[7] = codec << 8 | bits).
CODEC_POLAR = 0
CODEC_TQ = 1


class TierError(ValueError):
    """An unknown tier name or a width that a tier cannot encode."""


@dataclass(frozen=True)
class Tier:
    name: str
    kind: str  # "f32" | "fp8" | "tq" | "polar"
    bits: int  # bits per value: 32, 8, 4, or the polar B
    version: int  # on-disk format version: 1 f32, 2 kv8, 3 tq/polar

    @property
    def quantized(self) -> bool:
        return self.kind != "f32"

    @property
    def codec(self) -> int | None:
        """COLIKV3 codec id, or None for v1/v2 tiers."""
        return {"tq": CODEC_TQ, "polar": CODEC_POLAR}.get(self.kind)

    @property
    def tag(self) -> int:
        """The .coli_kv header word h[7]: 0 f32, 1 kv8, codec<<8|bits for v3."""
        if self.kind == "f32":
            return 0
        if self.kind == "fp8":
            return 1
        return (self.codec << 8) | self.bits

    def row_bytes(self, n: int) -> int:
        """Code bytes of one row of width n (the scale is not included)."""
        if n <= 0:
            raise TierError(f"{self.name}: row width {n=} must be positive")
        if self.kind == "f32":
            return 4 * n
        if self.kind == "fp8":
            return n
        if n % 2:
            raise TierError(f"{self.name}: row width {n=} must be even")
        if self.kind == "tq":
            return n // 2
        b, deep = self.bits, max(1, self.bits - 1)
        return math.ceil(((n // 2) * b + (n // 2 - 1) * deep) / 8)

    def width_error(self, kv_lora: int, rope: int) -> str | None:
        """Why a KV pool of this tier refuses rows of these widths, or None when it takes
        them: tq and polar rotate rows, which needs power-of-two widths 2..2048 (the codecs
        store any other width as inert zeros, which attention would read as nothing). The
        pools and the planner both ask here, so a plan never holds a tier its job refuses."""
        if self.kind in ("tq", "polar") and not (rotatable(kv_lora) and rotatable(rope)):
            return (f"tier {self.name} rotates rows, which needs power-of-two widths 2..2048; "
                    f"this model has kv_lora_rank {kv_lora} and qk_rope_head_dim {rope}: use f32 or kv8")
        return None

    def scale_bytes(self) -> int:
        """Bytes of the per-row scale on disk (f32 rows have none)."""
        return 0 if self.kind == "f32" else 4

    def token_bytes(self, kv_lora: int, rope: int) -> int:
        """Bytes per token per layer: both rows with their scales."""
        return (self.row_bytes(kv_lora) + self.row_bytes(rope)
                + 2 * self.scale_bytes())

    def code_dtype(self) -> str:
        """numpy dtype of the pool's code plane for this tier."""
        return "float32" if self.kind == "f32" else "uint8"

    def code_width(self, n: int) -> int:
        """Last-axis length of the code plane for rows of width n (elements of code_dtype)."""
        return n if self.kind == "f32" else self.row_bytes(n)


TIERS: dict[str, Tier] = {
    "f32": Tier("f32", "f32", 32, 1),
    "kv8": Tier("kv8", "fp8", 8, 2),
    "tq4": Tier("tq4", "tq", 4, 3),
    **{f"polar{b}": Tier(f"polar{b}", "polar", b, 3) for b in range(2, 7)},
}


def get_tier(name: str | Tier) -> Tier:
    """Look a tier up by name ('f32', 'kv8', 'tq4', 'polar2'..'polar6')."""
    if isinstance(name, Tier):
        return name
    try:
        return TIERS[name]
    except KeyError:
        raise TierError(f"unknown KV tier {name!r}; choose one of {sorted(TIERS)}") from None


def tier_from_tag(version: int, tag: int) -> Tier:
    """The tier a .coli_kv / Arrow header names (version 1/2/3 and the h[7] tag)."""
    if version == 1 and tag == 0:
        return TIERS["f32"]
    if version == 2 and tag == 1:
        return TIERS["kv8"]
    if version == 3:
        # exactly codec << 8 | bits: a tag with any other bit set names no known tier
        for t in TIERS.values():
            if t.version == 3 and t.tag == tag:
                return t
        known = ", ".join(f"{t.tag:#x} {t.name}" for t in TIERS.values() if t.version == 3)
        raise TierError(f"unsupported v3 codec/bits: tag {tag:#x} (codec {tag >> 8}, "
                        f"{tag & 0xFF}-bit) is none of codec << 8 | bits = {known}")
    raise TierError(f"unsupported KV format version {version} with tag {tag:#x}")
