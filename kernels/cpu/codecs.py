"""Row codecs of every KV tier, dispatched on `Tier.kind` (the numpy reference backend).

    encode_rows(tier, x[..., n] f32)          -> (codes[..., code_width(n)], scales[...] f32)
    decode_rows(tier, codes, scales, n)       -> f32[..., n]

Any leading shape is accepted (rows are flattened, encoded independently and reshaped back).
The f32 tier is the identity: codes are the float32 rows (a copy) and the scales are ones.
The byte contract of each tier is in DESIGN.md "KV tiers" and in the tier's module:
kernels/cpu/fp8.py (kv8), tq4.py (tq4), polar.py (polar2..6), rotation.py (shared).
"""
from __future__ import annotations

import numpy as np

from kernels.cpu import fp8, polar, tq4
from kernels.tiers import Tier, TierError, get_tier


def _flat(a: np.ndarray, width: int, what: str) -> np.ndarray:
    if a.ndim < 1 or a.shape[-1] != width:
        raise TierError(f"{what} must have last axis {width}, got shape {a.shape}")
    return a.reshape(-1, width)


def as_codes(tier: Tier, codes) -> np.ndarray:
    """codes in the tier's code dtype; a cast that would change a value is an error (a plain
    asarray wraps 256 to 0 and -1 to 0xFF, truncates float codes and reads uint8 bytes as
    f32 values)."""
    codes = np.asarray(codes)
    want = np.dtype(tier.code_dtype())
    if codes.dtype == want:
        return codes
    if want == np.uint8:
        ok = codes.dtype.kind in "iu" and (codes.size == 0 or (codes.min() >= 0 and codes.max() <= 255))
    else:  # (float codes of the f32 tier: a float64 value float32 cannot hold is refused)
        ok = codes.dtype.kind == "f" and bool(np.all(
            (codes.astype(want) == codes) | np.isnan(codes)))
    if not ok:
        like = "integers in 0..255" if want == np.uint8 else "floats"
        raise TierError(f"{tier.name}: codes must be {want.name} ({like}), got "
                        f"{codes.dtype.name}" + (f" in {codes.min()}..{codes.max()}"
                                                 if codes.dtype.kind in "iu" and codes.size else ""))
    return codes.astype(want)


def encode_rows(tier: Tier | str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode float32 rows x[..., n] with the tier's codec; see the module docstring."""
    tier = get_tier(tier)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1:
        raise TierError(f"{tier.name}: x must have a row axis, got shape {x.shape}")
    lead, n = x.shape[:-1], x.shape[-1]
    width = tier.code_width(n)  # raises TierError for widths the tier cannot hold
    rows = x.reshape(-1, n)
    if tier.kind == "f32":
        codes, scales = rows.copy(), np.ones(rows.shape[0], dtype=np.float32)
    elif tier.kind == "fp8":
        codes, scales = fp8.encode(rows)
    elif tier.kind == "tq":
        codes, scales = tq4.encode(rows)
    elif tier.kind == "polar":
        codes, scales = polar.encode(rows, tier.bits)
    else:
        raise TierError(f"{tier.name}: no numpy codec for kind {tier.kind!r}")
    return codes.reshape(*lead, width), scales.reshape(lead)


def decode_rows(tier: Tier | str, codes: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    """Decode codes[..., code_width(n)] with scales[...] to float32 rows [..., n]."""
    tier = get_tier(tier)
    width = tier.code_width(n)
    codes = as_codes(tier, codes)
    scales = np.asarray(scales, dtype=np.float32)
    lead = codes.shape[:-1]
    if scales.shape != lead:
        raise TierError(f"{tier.name}: scales shape {scales.shape} must equal codes' leading "
                        f"shape {lead}")
    flat, s = _flat(codes, width, f"{tier.name} codes"), scales.reshape(-1)
    if tier.kind == "f32":
        out = flat.copy()
    elif tier.kind == "fp8":
        out = fp8.decode(flat, s)
    elif tier.kind == "tq":
        out = tq4.decode(flat, s, n)
    elif tier.kind == "polar":
        out = polar.decode(flat, s, n, tier.bits)
    else:
        raise TierError(f"{tier.name}: no numpy codec for kind {tier.kind!r}")
    return out.reshape(*lead, n)
