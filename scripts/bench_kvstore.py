"""Save / load throughput of the on-disk KV caches, per tier and format.

    python scripts/bench_kvstore.py [--tokens 32768] [--chunk 512] [--dir /tmp] [--repeat 3]

For the shipped tiny model's fingerprint (scripts/make_tiny_model.py: 3 layers, kv_lora 512,
rope 64, vocab 512, no DSA) it writes a cache of --tokens records per tier, once as one
append ("bulk") and once in --chunk-token appends (as a prefill in chunks would), each append
fsync'd, then loads it back (read, checksum / commit checks, unpack, sanitize). MB/s is file
bytes over wall seconds; the best of --repeat runs is printed.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.tiers import get_tier  # noqa: E402
from kvstore.coli import ColiKVFile  # noqa: E402
from kvstore.disk import ArrowKVFile  # noqa: E402
from kvstore.fingerprint import Fingerprint  # noqa: E402
from kvstore.records import RecordLayout  # noqa: E402
from scripts.make_tiny_model import base_config  # noqa: E402
from workers.config import ModelConfig  # noqa: E402

TIERS = ["f32", "kv8", "tq4", "polar3"]
FORMATS = {"arrow": ArrowKVFile, "coli": ColiKVFile}


def tiny_fingerprint() -> Fingerprint:
    """The fingerprint of make_tiny_model.py's config."""
    return Fingerprint.from_config(ModelConfig.from_dict(base_config(set()), source="make_tiny_model"))


def make_records(fp: Fingerprint, tier, n: int, rng: np.random.Generator):
    tier = get_tier(tier)
    r = RecordLayout(fp, tier).allocate(n)
    r.tokens[:] = rng.integers(0, fp.vocab, n)
    for codes in (r.l_codes, r.r_codes):
        if tier.kind == "f32":
            codes[:] = rng.standard_normal(codes.shape, np.float32)
        else:
            codes[:] = rng.integers(0, 0x7F, codes.shape, np.uint8)
    if tier.quantized:
        r.l_scale[:] = rng.uniform(0.01, 1, r.l_scale.shape)
        r.r_scale[:] = rng.uniform(0.01, 1, r.r_scale.shape)
    return r


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(fp, tier, fmt, n, chunk, tmp, repeat, rng):
    recs = make_records(fp, tier, n, rng)
    path = os.path.join(tmp, f"bench.{fmt}")
    cls = FORMATS[fmt]
    best = {"bulk": 1e9, "chunked": 1e9, "load": 1e9}

    def fresh():  # (outside the timing: deleting a full-size file costs 35-55 ms)
        if os.path.exists(path):
            os.unlink(path)

    def save(step):
        f = cls(path, fp, tier)
        f.load()
        for s in range(0, n, step):
            f.append(recs.slice(s, min(n, s + step)))

    for _ in range(repeat):
        fresh()
        best["chunked"] = min(best["chunked"], timed(lambda: save(chunk)))
        fresh()
        best["bulk"] = min(best["bulk"], timed(lambda: save(n)))
        best["load"] = min(best["load"], timed(lambda: cls(path, fp, tier).load()))
    got = cls(path, fp, tier).load()
    assert len(got) == n and np.array_equal(got.tokens, recs.tokens)
    size = os.path.getsize(path)
    os.unlink(path)
    return size, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiers", nargs="+", default=TIERS)
    args = ap.parse_args()
    fp = tiny_fingerprint()
    rng = np.random.default_rng(0)
    print(f"model {fp.describe()}; {args.tokens} tokens; chunked = {args.chunk}-token appends; "
          f"best of {args.repeat}")
    head = f"{'tier':8} {'format':6} {'file MB':>8} {'save bulk MB/s':>15} {'save chunked MB/s':>18} {'load MB/s':>10}"
    print(head)
    print("-" * len(head))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for tier in args.tiers:
            for fmt in FORMATS:
                size, t = bench(fp, tier, fmt, args.tokens, args.chunk, tmp, args.repeat, rng)
                mb = size / 1e6
                print(f"{tier:8} {fmt:6} {mb:8.1f} {mb / t['bulk']:15.0f} {mb / t['chunked']:18.0f} "
                      f"{mb / t['load']:10.0f}", flush=True)


if __name__ == "__main__":
    main()
