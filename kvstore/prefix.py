"""Prefix reuse: resume a slot from the saved records its new prompt starts with.

    recs = reuse_prefix(cache_file, prompt_tokens)   # records for prompt[:len(recs)]
    to_pool(pool, slot, recs)                        # codes copied as stored, no re-encode
    # prefill only prompt[len(recs):], then
    cache_file.append(from_pool(pool, slot, prompt_tokens, start=len(recs)))

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
    """Load `f` and keep the records matching `prompt`'s prefix, truncating the file to them
    (see CacheFile.truncate for a file that is being upgraded: its cut lands with the next
    append).

    At most len(prompt) - keep_last records are reused, so that the model still runs on
    at least `keep_last` prompt tokens and produces the logits of the last one."""
    if keep_last < 0:
        raise ValueError(f"{keep_last=} must be >= 0")
    recs = f.load()
    k = min(common_prefix(recs.tokens, prompt), max(0, len(prompt) - keep_last))
    if k < f.length():
        f.truncate(k)
    return recs.slice(0, k)


def to_pool(pool, slot: int, recs: KVRecords, start: int = 0) -> None:
    """Write records into a kvstore.pool.KVPool slot at positions [start, start + len(recs))."""
    if len(recs) == 0:
        return
    want = (np.dtype(pool.tier.code_dtype()), pool.tier.code_width(pool.kv_lora),
            pool.tier.code_width(pool.rope))
    got = (recs.l_codes.dtype, recs.l_codes.shape[-1], recs.r_codes.shape[-1])
    if got != want or recs.l_codes.shape[0] != pool.n_layers:
        raise ValueError(f"records ({recs.l_codes.shape[0]} layers, codes {got}) do not fit a "
                         f"{pool.tier.name} pool ({pool.n_layers} layers, codes {want})")
    pos = np.arange(start, start + len(recs))
    slots = np.full(len(recs), slot)
    for layer in range(pool.n_layers):
        pool.write_coded(layer, slots, pos, recs.l_codes[layer], recs.l_scale[layer],
                         recs.r_codes[layer], recs.r_scale[layer])


def from_pool(pool, slot: int, tokens: np.ndarray, start: int = 0, end: int | None = None,
              index_rows: np.ndarray | None = None) -> KVRecords:
    """Records [start, end) of a pool slot; `tokens` is the slot's whole token sequence
    (the pool does not keep tokens), index_rows the DSA rows of [start, end) if any."""
    end = pool.length(slot) if end is None else end
    rows = [pool.read_rows(slot, layer, start, end) for layer in range(pool.n_layers)]
    lc, ls, rc, rs = (np.stack([r[i] for r in rows]) for i in range(4))
    toks = np.asarray(tokens, np.int32)[start:end]
    if len(toks) != end - start:
        raise ValueError(f"tokens cover {len(tokens)} positions, need [{start}, {end})")
    return KVRecords(np.ascontiguousarray(toks), lc, ls, rc, rs, index_rows)
