"""In-process generation for one prompt: prefill, then decode token by token through a pool.

The simple path for a first run and for tests; the cluster's batched job lives in cluster/.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.pool import KVPool
from workers.model import Model
from workers.sampling import SamplingParams, sample
from workers.tokenizer import Tokenizer


@dataclass(frozen=True)
class Generation:
    prompt_ids: list[int]
    ids: list[int]  # generated ids, the stopping EOS excluded
    finish_reason: str  # "stop" (an EOS id) or "length"


def generate_ids(model: Model, prompt_ids: list[int], params: SamplingParams,
                 eos_ids: tuple[int, ...] = (), tier: str = "f32") -> Generation:
    if not prompt_ids:
        raise ValueError("prompt is empty: nothing to condition on")
    n = len(prompt_ids)
    pool = KVPool.for_model(model.config, tier, slots=1, max_ctx=n + params.max_tokens + 1)
    slot = pool.alloc_slot()
    rng = params.rng()
    logits = model.forward(prompt_ids, [slot] * n, np.arange(n), pool, logits_at=[n - 1])
    out: list[int] = []
    for step in range(params.max_tokens):
        tok = int(sample(logits, params, rng)[0])
        if tok in eos_ids:
            return Generation(list(prompt_ids), out, "stop")
        out.append(tok)
        if step + 1 < params.max_tokens:
            logits = model.forward([tok], [slot], [n + step], pool)
    return Generation(list(prompt_ids), out, "length")


def generate_text(model: Model, tokenizer: Tokenizer, prompt: str, max_tokens: int = 64,
                  sampling: SamplingParams | None = None, tier: str = "f32") -> str:
    """The completion text of one prompt (stops at any EOS id or after max_tokens)."""
    base = sampling or SamplingParams()
    params = SamplingParams(base.temperature, base.top_p, base.top_k, max_tokens, base.seed)
    gen = generate_ids(model, tokenizer.encode(prompt, add_bos=True), params, tokenizer.eos_ids, tier)
    return tokenizer.decode(gen.ids)
