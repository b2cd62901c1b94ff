"""The writer that tests/kvstore/test_crash.py SIGKILLs: appends deterministic records forever.

Record content depends only on the position, so any prefix of the file can be checked
against `expected(fp, tier, 0, n)` whatever chunking the killed writers used.
"""
from __future__ import annotations

import os

import numpy as np

from kernels.tiers import get_tier
from kvstore.coli import ColiKVFile
from kvstore.disk import ArrowKVFile
from kvstore.fingerprint import Fingerprint
from kvstore.records import KVRecords, RecordLayout

CLASSES = {"arrow": ArrowKVFile, "coli": ColiKVFile}


def expected(fp: Fingerprint, tier, start: int, n: int) -> KVRecords:
    tier = get_tier(tier)
    r = RecordLayout(fp, tier).allocate(n)
    pos = np.arange(start, start + n, dtype=np.int64)
    r.tokens[:] = (pos * 7919 + 13) % fp.vocab
    for i in range(fp.n_layers):
        for codes in (r.l_codes, r.r_codes):
            j = np.arange(codes.shape[-1])
            if tier.kind == "f32":
                x = np.sin(pos[:, None] * 0.37 + j * 0.11 + i).astype(np.float32) * 50
                x[pos % 17 == 3, 5] = np.nan  # hostile values survive byte-exactly
                x[pos % 13 == 1, 2] = np.inf
                codes[i] = x
            else:
                v = pos[:, None] * 31 + j * 7 + i * 13
                codes[i] = (v % 127 | (v // 127 % 2) << 7).astype(np.uint8)  # never 0x7F/0xFF
        if tier.quantized:  # f32 rows carry no scale on disk (ones in memory)
            r.l_scale[i] = (pos % 1000 + 1).astype(np.float32) * 0.5
            r.r_scale[i] = (pos % 777 + 2).astype(np.float32) * 0.25
    if fp.index_hd:
        r.index_rows[:] = (pos[None, :, None] % 101 + np.arange(fp.index_hd)).astype(np.float32)
    return r


def write_forever(path: str, fmt: str, fp: Fingerprint, tier: str, max_chunk: int, conn) -> None:
    """Load (healing a torn tail on the first append), then append chunks; after each
    durable append send the number of records on disk."""
    f = CLASSES[fmt](path, fp, tier)
    n = len(f.load())
    conn.send(("loaded", n))
    rng = np.random.default_rng(os.getpid())
    while True:
        k = int(rng.integers(1, max_chunk + 1))
        n = f.append(expected(fp, tier, n, k))
        conn.send(("acked", n))
