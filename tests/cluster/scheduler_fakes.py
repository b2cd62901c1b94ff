"""A fake model and pool that check the scheduler's bookkeeping strictly.

FakePool keeps the token written at every (slot, position); a freed slot is refilled with
garbage (-7), so a sequence that reads a position nobody wrote for it fails loudly.
FakeModel's logits at a row are a hash of the whole token history of the row's slot up to
the row's position: any scheduler slip (wrong position, wrong slot, missing chunk, a slot
shared by two sequences) changes the outputs or raises.
"""
from __future__ import annotations

import numpy as np

GARBAGE = -7
VOCAB = 40
EOS = 0


class FakePool:
    def __init__(self, slots: int, max_ctx: int):
        self.tok = np.full((slots, max_ctx), GARBAGE, np.int64)
        self.used = np.zeros(slots, bool)
        self.len = np.zeros(slots, np.int64)

    def alloc_slot(self) -> int:
        free = np.flatnonzero(~self.used)
        assert free.size, "pool full"
        s = int(free[-1])  # hand out high ids first: the scheduler must not assume an order
        self.used[s] = True
        self.len[s] = 0
        return s

    def free_slot(self, s: int) -> None:
        assert self.used[s], f"slot {s} freed twice"
        self.used[s] = False
        self.tok[s] = GARBAGE

    def bytes_in_use(self) -> int:
        return int(self.len[self.used].sum()) * 8


class FakeModel:
    def __init__(self, vocab: int = VOCAB, eos_bias: float = 0.0):
        self.vocab, self.eos_bias = vocab, eos_bias
        self.calls: list[tuple[int, int]] = []  # (tokens, sampled rows) per forward

    def forward(self, tokens, slots, positions, pool: FakePool, logits_at=None):
        tokens, slots, positions = (np.asarray(a, np.int64) for a in (tokens, slots, positions))
        assert tokens.shape == slots.shape == positions.shape
        for s in np.unique(slots):
            p = positions[slots == s]
            assert pool.used[s], f"slot {s} not allocated"
            assert p[0] == pool.len[s] and np.all(np.diff(p) == 1), \
                f"slot {s}: positions {p.tolist()} do not continue length {pool.len[s]}"
            pool.len[s] = p[-1] + 1
        pool.tok[slots, positions] = tokens
        at = np.arange(len(tokens)) if logits_at is None else np.asarray(logits_at)
        self.calls.append((len(tokens), len(at)))
        out = np.empty((len(at), self.vocab), np.float32)
        for i, r in enumerate(at):
            hist = pool.tok[slots[r], :positions[r] + 1]
            assert (hist >= 0).all(), f"read unwritten KV in slot {slots[r]}: {hist.tolist()}"
            h = int(np.bitwise_xor.reduce(hist * 1000003 + np.arange(len(hist)) * 7919)) % 10007
            rng = np.random.default_rng(h + 31 * len(hist))
            out[i] = rng.standard_normal(self.vocab).astype(np.float32)
            out[i, EOS] += self.eos_bias
        return out


def decode(ids) -> str:
    return "".join(chr(ord("a") + (int(t) % 26)) for t in ids)
