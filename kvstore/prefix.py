"""Prefix reuse: resume a slot from the saved records its new prompt starts with.

    recs = reuse_prefix(cache_file, prompt_tokens)   # records for prompt[:len(recs)]
    # prefill only prompt[len(recs):], then cache_file.append(new_records)

The saved records whose tokens equal the prompt's first tokens are reused; the file is cut
back to that many records when it holds more (the prompt diverged or is shorter), so the
next append continues right after the reused prefix.
"""
from __future__ import annotations

import numpy as np

from kvstore.cachefile import CacheFile
from kvstore.records import KVRecords


def common_prefix(saved: np.ndarray, prompt: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    saved, prompt = np.asarray(saved), np.asarray(prompt)
    n = min(len(saved), len(prompt))
    diff = np.flatnonzero(saved[:n] != prompt[:n])
    return int(diff[0]) if diff.size else n


def reuse_prefix(f: CacheFile, prompt: np.ndarray, keep_last: int = 1) -> KVRecords:
    """Load `f` and keep the records matching `prompt`'s prefix, truncating the file to them.

    At most len(prompt) - keep_last records are reused, so that the model still runs on
    at least `keep_last` prompt tokens and produces the logits of the last one."""
    if keep_last < 0:
        raise ValueError(f"{keep_last=} must be >= 0")
    recs = f.load()
    k = min(common_prefix(recs.tokens, prompt), max(0, len(prompt) - keep_last))
    if k < f.length():
        f.truncate(k)
    return recs.slice(0, k)
