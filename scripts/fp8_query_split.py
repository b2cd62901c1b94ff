"""How accurate would kv8 scores be on fp8 tensor cores? (CPU, numpy + ml_dtypes)

attn_wg converts the e4m3 key codes to f16 in registers for its score products (S^T), and
those conversions are a large part of a step. An fp8 wgmma (e4m3 x e4m3, f32 accumulate)
could read the key codes from shared memory as they are, if the queries were e4m3 too. This
script measures what that costs in accuracy, against float64 over the same decoded cache.

The query is taken per head to max |q| = 1, as attn_wg does, and then represented as:
  f16         today's operand
  e4m3        one fp8 part
  hi+lo       two parts, lo = e4m3(q - hi), both products in one accumulator
  hi+lo*16    lo = e4m3(16 (q - hi)), its products in a second accumulator scaled by 1/16
  3 parts     hi, mid and lo, each residual scaled by 16 into its own accumulator

It prints the largest relative error of the attention context over the heads, for ordinary
and for sharp attention (the queries scaled up). The kernel's tests require 2e-3; attn_wg
measures 4.5e-4 today.

    python3 scripts/fp8_query_split.py [--tokens 4096] [--heads 64] [--seed 0]
"""
from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
DL, DR = 512, 64


def e4m3(x: np.ndarray) -> np.ndarray:
    """x rounded to e4m3 (saturating at +-448), as float64."""
    return np.clip(x, -448.0, 448.0).astype(E4M3).astype(np.float64)


def encode_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kv8 rows: per-row scale amax / 448 and e4m3 codes (decoded values = codes * scale)."""
    s = np.abs(x).max(axis=1, keepdims=True) / 448.0
    s[s == 0] = 1.0
    return e4m3(x / s), s


def query_parts(q: np.ndarray, kind: str) -> list[tuple[np.ndarray, float]]:
    """(operand, weight of its accumulator) pairs whose weighted sum approximates q."""
    if kind == "f16":
        return [(q.astype(np.float16).astype(np.float64), 1.0)]
    hi = e4m3(q)
    if kind == "e4m3":
        return [(hi, 1.0)]
    if kind == "hi+lo":
        return [(hi, 1.0), (e4m3(q - hi), 1.0)]
    lo = e4m3(16.0 * (q - hi))
    if kind == "hi+lo*16":
        return [(hi, 1.0), (lo, 1.0 / 16.0)]
    if kind == "3 parts":
        lo3 = e4m3(16.0 * (16.0 * (q - hi) - lo))
        return [(hi, 1.0), (lo, 1.0 / 16.0), (lo3, 1.0 / 256.0)]
    raise ValueError(kind)


def rel_err(ctx: np.ndarray, want: np.ndarray) -> float:
    """largest over heads of ||ctx - want|| / ||want||"""
    return float((np.linalg.norm(ctx - want, axis=1) / np.linalg.norm(want, axis=1)).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    T, H = args.tokens, args.heads
    # latent and rope rows with per-token magnitudes spread over 2^+-2, as real caches vary
    mag = np.exp2(rng.uniform(-2, 2, (T, 1)))
    cl, sl = encode_rows(rng.standard_normal((T, DL)) * mag)
    cr, sr = encode_rows(rng.standard_normal((T, DR)) * mag)
    kl, kr = cl * sl, cr * sr  # the decoded cache: what the kernel and the reference attend to
    scale = 1.0 / np.sqrt(DL + DR)
    print(f"{T} tokens, {H} heads; context error (max over heads) against float64")
    print(f"{'sharpness':>10} " + " ".join(f"{k:>10}" for k in
                                            ("f16", "e4m3", "hi+lo", "hi+lo*16", "3 parts")))
    for sharp in (1.0, 4.0, 16.0):
        ql = rng.standard_normal((H, DL)) * sharp
        qr = rng.standard_normal((H, DR)) * sharp
        want_s = (ql @ kl.T + qr @ kr.T) * scale
        p = np.exp(want_s - want_s.max(axis=1, keepdims=True))
        want = (p / p.sum(axis=1, keepdims=True)) @ kl
        m = np.maximum(np.abs(ql).max(axis=1, keepdims=True), np.abs(qr).max(axis=1, keepdims=True))
        row = []
        for kind in ("f16", "e4m3", "hi+lo", "hi+lo*16", "3 parts"):
            # products of the query parts with the codes (exact in f32 accumulation up to
            # rounding, modelled here in float64), then the per-row scales, as in attn_wg
            s = sum(w * ((pl @ cl.T) * sl.T + (pr @ cr.T) * sr.T)
                    for (pl, w), (pr, _) in zip(query_parts(ql / m, kind), query_parts(qr / m, kind)))
            s = s * m * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            row.append(rel_err((p / p.sum(axis=1, keepdims=True)) @ kl, want))
        print(f"{sharp:>10.0f} " + " ".join(f"{e:>10.2e}" for e in row))


if __name__ == "__main__":
    main()
