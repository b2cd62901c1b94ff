"""The key-value retrieval task that the shipped model is trained on and the quality oracle asks.

A document is a list of pair lines, then question lines whose answer is a pair far back:

    k482: v731
    k090: v115
    ...
    value of k482? v731

Keys and values are three digits (zero-padded). The tokenizer splits digits one by one, so
a line is about ten tokens and a 1024-token context holds about a hundred pairs. Training
documents (scripts/make_training_data.py) draw from `numpy.random.default_rng(train seed)`;
the oracle's items draw from ORACLE_SEED, a seed no training run uses, so an oracle prompt
is never a training document.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KEY_SPACE = 1000  # keys and values are 000..999
ORACLE_SEED = 0x0AC1E  # the oracle's items; training seeds must differ (the trainer checks)
PAIR_TOKENS = 10  # "k" d d d ":" " v" d d d "\n"
QUESTION_TOKENS = 12  # "value" " of" " k" d d d "?" " v" d d d "\n"


def pair_line(key: int, value: int) -> str:
    return f"k{key:03d}: v{value:03d}\n"


def question(key: int) -> str:
    return f"value of k{key:03d}?"


def answer(value: int) -> str:
    return f" v{value:03d}"


@dataclass(frozen=True)
class Item:
    """One oracle question: the prompt is `body + question`; the right greedy continuation
    starts with `answer`. Items of one document share `body` (an engine may prefill it once
    and copy its cache rows). `depth` is how many pair lines back the asked pair sits."""
    body: str
    question: str
    answer: str
    doc: int
    depth: int

    @property
    def prompt(self) -> str:
        return self.body + self.question


def pairs_for_context(context_tokens: int) -> int:
    """How many pair lines fill a prompt of about `context_tokens` tokens (one question)."""
    n = (context_tokens - QUESTION_TOKENS) // PAIR_TOKENS
    if n < 2:
        raise ValueError(f"context {context_tokens} tokens is too short for a retrieval item "
                         f"(needs at least {2 * PAIR_TOKENS + QUESTION_TOKENS})")
    return n


def oracle_items(n_items: int, context_tokens: int, per_doc: int = 8,
                 seed: int = ORACLE_SEED) -> list[Item]:
    """`n_items` questions over ceil(n_items / per_doc) documents of about `context_tokens`
    tokens. A document's questions ask distinct pairs from the first half of its list (so the
    answer is far back) when that half is big enough, else distinct pairs from the whole list.
    Deterministic in (n_items, context_tokens, per_doc, seed)."""
    if n_items <= 0 or per_doc <= 0:
        raise ValueError(f"n_items and per_doc must be positive, got {n_items}, {per_doc}")
    n_pairs = pairs_for_context(context_tokens)
    rng = np.random.default_rng([seed, context_tokens])
    items: list[Item] = []
    doc = 0
    while len(items) < n_items:
        k = min(per_doc, n_items - len(items), n_pairs)  # (a short context: more documents)
        keys = rng.choice(KEY_SPACE, size=n_pairs, replace=False)
        values = rng.integers(0, KEY_SPACE, size=n_pairs)
        pool = n_pairs // 2 if n_pairs // 2 >= k else n_pairs
        asked = rng.choice(pool, size=k, replace=False)
        body = "".join(pair_line(int(a), int(b)) for a, b in zip(keys, values))
        items += [Item(body=body, question=question(int(keys[a])), answer=answer(int(values[a])),
                       doc=doc, depth=n_pairs - int(a)) for a in asked]
        doc += 1
    return items


def is_correct(item: Item, completion: str) -> bool:
    """The completion must start with the answer and not continue it with another digit."""
    if not completion.startswith(item.answer):
        return False
    rest = completion[len(item.answer):]
    return not (rest[:1].isdigit())
