"""How precise kv8 attention would stay with its queries in e4m3 (issue 6: S^T on the fp8
tensor cores, which would read the e4m3 key codes straight from shared memory), measured on
the CPU before any kernel is written.

    python3 scripts/fp8_query_precision.py [--heads 64] [--tokens 4096] [--contexts 6]
                                           [--sharpness 1]

Keys are kv8-coded rows (kernels/cpu/codecs), with per-token magnitudes as in
tests/gpu/test_attention_gpu.py; queries are standard normal times --sharpness (above 1: the
scores spread wider and the attention is sharper). For each form of the query the
script prints the relative L2 error of the attention context (per query, over all heads, as
the GPU tests measure it) against float64 with exact queries, everything else exact:

    f16             what attn_wg uses now (per head scaled to max |q| = 1)
    e4m3 x1         one e4m3 term (per head scaled to max |q| = 448)
    e4m3 x2         two e4m3 terms, q1 = e4m3(q), q2 = e4m3(q - q1), one accumulator
    e4m3 x2 scaled  the same with q2 scaled by 16 (a second accumulator, or its products
                    scaled back)
    e4m3 x3         three terms, one accumulator (1.5x the f16 products' tensor time)

The GPU tests bound the whole kernel's error by 2e-3 (attn_wg measures 4-5e-4 today).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.cpu import codecs  # noqa: E402

DL, DR = 512, 64
SCALE = 1.0 / np.sqrt(192.0)  # as tests/gpu
E4M3 = ml_dtypes.float8_e4m3fn


def e4m3(x: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3 value (|x| <= 448 here), back as float64."""
    return np.asarray(x, dtype=np.float32).astype(E4M3).astype(np.float64)


def query_forms(q: np.ndarray) -> dict[str, np.ndarray]:
    """q [H, DL + DR] float64 -> each form's query, in q's own scale."""
    m = np.abs(q).max(axis=1, keepdims=True)
    m[m == 0] = 1.0
    f16 = (q / m).astype(np.float16).astype(np.float64) * m
    x = q / m * 448.0
    q1 = e4m3(x)
    r = x - q1
    return {
        "f16": f16,
        "e4m3 x1": q1 * m / 448.0,
        "e4m3 x2": (q1 + e4m3(r)) * m / 448.0,
        "e4m3 x2 scaled": (q1 + e4m3(r * 16.0) / 16.0) * m / 448.0,
        "e4m3 x3": (q1 + e4m3(r) + e4m3(r - e4m3(r))) * m / 448.0,
    }


def context(q: np.ndarray, L: np.ndarray, R: np.ndarray) -> np.ndarray:
    s = (q[:, :DL] @ L.T + q[:, DL:] @ R.T) * SCALE
    s -= s.max(axis=1, keepdims=True)
    w = np.exp(s)
    return (w / w.sum(axis=1, keepdims=True)) @ L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--contexts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sharpness", type=float, default=1.0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    errs: dict[str, list[float]] = {}
    for _ in range(args.contexts):
        L = rng.standard_normal((args.tokens, DL)).astype(np.float32)
        R = rng.standard_normal((args.tokens, DR)).astype(np.float32)
        L *= np.exp(rng.uniform(-1, 0.5, (args.tokens, 1))).astype(np.float32)
        Ld = codecs.decode_rows("kv8", *codecs.encode_rows("kv8", L), DL).astype(np.float64)
        Rd = codecs.decode_rows("kv8", *codecs.encode_rows("kv8", R), DR).astype(np.float64)
        q = rng.standard_normal((args.heads, DL + DR)) * args.sharpness
        want = context(q, Ld, Rd)
        for name, qf in query_forms(q).items():
            got = context(qf, Ld, Rd)
            errs.setdefault(name, []).append(float(np.linalg.norm(got - want) / np.linalg.norm(want)))
    print(f"{args.contexts} contexts of {args.tokens} kv8 tokens, {args.heads} heads, queries x "
          f"{args.sharpness:g}: relative "
          f"L2 error of the context from the query's rounding alone (bound of the tests: 2e-3)")
    for name, e in errs.items():
        print(f"  {name:15} max {max(e):.2e}  mean {np.mean(e):.2e}")


if __name__ == "__main__":
    main()
