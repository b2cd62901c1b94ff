"""`kvfleet bench quality`: what each KV tier costs in answers, through kvfleet's own engine.

Per tier (a fresh KVPool in that tier; workers/model.py Model on numpy):
  retrieval       the oracle (cluster/bench/retrieval_task.py): --items key-value questions at
                  each --contexts length, --per-doc questions per document; a document is
                  prefilled once and its coded cache rows are copied into one slot per question
                  (the same rows a separate prefill would write), then all questions are
                  prefilled as one flat batch and answered greedily as one ragged decode.
                  Count of correct answers per context.
  perplexity      teacher-forced decode of held-out text (heldout.txt in the model dir):
                  --ppl-seqs slots of --ppl-len tokens, one token per slot per step, so every
                  position < t is read back from the tier's cache.
  top1_agreement  over a fixed set of greedy continuations made with f32 (--agree-prompts
  rel_logit_err   prompts of 96 held-out tokens, --agree-steps tokens each): the fraction of
                  steps where the tier's argmax equals f32's, and the mean ||l - l_f32|| /
                  ||l_f32|| of the logits, the tier teacher-forced along f32's continuation.
Targets (issue 7 / 10): f32 retrieval >= 30/32 at the longest trained context; kv8 within 1
of f32 and tq4 within 4; perplexity kv8 within 1% of f32, tq4 within 5%.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from cluster.bench import retrieval_task as rt
from cluster.bench.timing import blas_threads
from cluster.cli import UsageError
from kernels.tiers import TIERS

HELP = "per-tier retrieval accuracy, perplexity and agreement with f32 through the engine"
DEFAULT_TIERS = ["f32", "kv8", "tq4", "polar3"]
AGREE_PROMPT = 96
ANSWER_TOKENS = 5  # " v" d d d "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, metavar="DIR", help="model dir (default: the shipped kvfleet-mini)")
    p.add_argument("--tiers", nargs="+", choices=sorted(TIERS), default=DEFAULT_TIERS,
                   help=f"KV tiers (default: {' '.join(DEFAULT_TIERS)}); f32 is always run as the reference")
    p.add_argument("--items", type=int, default=32, help="retrieval questions per context (default 32)")
    p.add_argument("--per-doc", type=int, default=8, help="questions per retrieval document (default 8)")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024],
                   help="retrieval prompt lengths in tokens (default 256 512 1024)")
    p.add_argument("--ppl-seqs", type=int, default=8, help="held-out sequences (slots) for perplexity")
    p.add_argument("--ppl-len", type=int, default=384, help="tokens per held-out sequence")
    p.add_argument("--agree-prompts", type=int, default=8, help="prompts for the f32 agreement check")
    p.add_argument("--agree-steps", type=int, default=32, help="greedy steps per agreement prompt")
    p.add_argument("--blas-threads", type=int, default=1,
                   help="numpy BLAS threads (default 1: the engine's small decode matmuls run "
                        "many times faster on one thread than on an oversubscribed pool)")


class Engine:
    """A loaded model and tokenizer; every method takes a fresh pool in the given tier."""

    def __init__(self, model_dir: Path):
        from workers.model import Model
        from workers.tokenizer import Tokenizer
        self.model = Model.load(model_dir)
        self.tok = Tokenizer.from_dir(model_dir)

    def pool(self, tier: str, slots: int, max_ctx: int):
        from kvstore.pool import KVPool
        return KVPool.for_model(self.model.config, tier, slots=slots, max_ctx=max_ctx)

    def step(self, pool, slots, tokens, positions, logits_at=None) -> np.ndarray:
        return self.model.forward(np.asarray(tokens), np.asarray(slots), np.asarray(positions),
                                  pool, logits_at=logits_at)


def retrieval(eng: Engine, tier: str, items: list[rt.Item]) -> int:
    bodies = {}
    for it in items:
        bodies.setdefault(it.doc, eng.tok.encode(it.body))
    qs = [eng.tok.encode(it.question) for it in items]
    for it, q in zip(items, qs):  # the split must be the prompt's own tokenization
        if eng.tok.encode(it.prompt) != bodies[it.doc] + q:
            raise RuntimeError(f"retrieval prompt of document {it.doc} does not tokenize as body + question")
    longest = max(len(bodies[it.doc]) + len(q) for it, q in zip(items, qs)) + ANSWER_TOKENS
    pool = eng.pool(tier, len(bodies) + len(items), longest)
    L = eng.model.config.num_hidden_layers
    doc_slot = {}
    for d, ids in bodies.items():
        s = pool.alloc_slot()
        eng.step(pool, [s] * len(ids), ids, np.arange(len(ids)), logits_at=[len(ids) - 1])
        doc_slot[d] = s
    slots = []
    for it in items:  # copy the document's coded rows: no re-encode, no second prefill
        s = pool.alloc_slot()
        n = len(bodies[it.doc])
        for layer in range(L):
            pool.write_coded(layer, [s] * n, np.arange(n), *pool.read_rows(doc_slot[it.doc], layer))
        slots.append(s)
    tok = np.concatenate(qs)
    sl = np.concatenate([[s] * len(q) for s, q in zip(slots, qs)])
    pos = np.concatenate([len(bodies[it.doc]) + np.arange(len(q)) for it, q in zip(items, qs)])
    last = np.cumsum([len(q) for q in qs]) - 1
    nxt = eng.step(pool, sl, tok, pos, logits_at=last).argmax(-1)
    pos_next = pos[last] + 1
    out = [nxt]
    for _ in range(ANSWER_TOKENS - 1):
        nxt = eng.step(pool, slots, nxt, pos_next).argmax(-1)
        pos_next = pos_next + 1
        out.append(nxt)
    gen = np.stack(out, 1)
    return sum(rt.is_correct(it, eng.tok.decode(g.tolist())) for it, g in zip(items, gen))


def heldout_ids(eng: Engine, model_dir: Path, n_tokens: int) -> np.ndarray:
    path = model_dir / "heldout.txt"
    if not path.is_file():
        raise UsageError(f"--model {model_dir}: no heldout.txt (held-out text for perplexity)")
    ids = np.asarray(eng.tok.encode(path.read_text()), np.int64)
    if len(ids) < n_tokens:
        raise UsageError(f"{path}: {len(ids)} tokens, the perplexity and agreement checks need {n_tokens}")
    return ids[:n_tokens]


def perplexity(eng: Engine, tier: str, seqs: np.ndarray) -> float:
    """exp(mean NLL) of seqs [S, T] by teacher-forced decode, S slots in lockstep."""
    S, T = seqs.shape
    pool = eng.pool(tier, S, T)
    slots = np.array([pool.alloc_slot() for _ in range(S)])
    nll = 0.0
    for t in range(T - 1):
        logits = eng.step(pool, slots, seqs[:, t], np.full(S, t)).astype(np.float64)
        m = logits.max(-1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(logits - m).sum(-1)))
        nll += float((lse - logits[np.arange(S), seqs[:, t + 1]]).sum())
    return float(np.exp(nll / (S * (T - 1))))


def forced_logits(eng: Engine, tier: str, prompts: np.ndarray, cont: np.ndarray) -> np.ndarray:
    """Logits [P, steps, V]: prefill prompts [P, Tp] (one slot each, one flat batch), then
    teacher-force cont [P, steps] (row k: logits after prompt + cont[:, :k])."""
    P, Tp = prompts.shape
    steps = cont.shape[1]
    pool = eng.pool(tier, P, Tp + steps)
    slots = np.array([pool.alloc_slot() for _ in range(P)])
    out = [eng.step(pool, np.repeat(slots, Tp), prompts.reshape(-1), np.tile(np.arange(Tp), P),
                    logits_at=np.arange(P) * Tp + Tp - 1)]
    for k in range(steps - 1):
        out.append(eng.step(pool, slots, cont[:, k], np.full(P, Tp + k)))
    return np.stack(out, 1)


def greedy(eng: Engine, prompts: np.ndarray, steps: int) -> np.ndarray:
    """f32 greedy continuations [P, steps] of prompts [P, Tp]."""
    P, Tp = prompts.shape
    pool = eng.pool("f32", P, Tp + steps)
    slots = np.array([pool.alloc_slot() for _ in range(P)])
    nxt = eng.step(pool, np.repeat(slots, Tp), prompts.reshape(-1), np.tile(np.arange(Tp), P),
                   logits_at=np.arange(P) * Tp + Tp - 1).argmax(-1)
    out = [nxt]
    for k in range(steps - 1):
        nxt = eng.step(pool, slots, nxt, np.full(P, Tp + k)).argmax(-1)
        out.append(nxt)
    return np.stack(out, 1)


def run(args) -> dict:
    from cluster.config import DEFAULT_MODEL
    model_dir = args.model or DEFAULT_MODEL
    for flag in ("items", "per_doc", "ppl_seqs", "agree_prompts", "agree_steps", "blas_threads"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.ppl_len < 2:
        raise UsageError(f"--ppl-len must be >= 2, got {args.ppl_len}")
    too_short = [c for c in args.contexts if c < 2 * rt.PAIR_TOKENS + rt.QUESTION_TOKENS]
    if too_short:
        raise UsageError(f"--contexts {too_short}: a retrieval prompt needs at least "
                         f"{2 * rt.PAIR_TOKENS + rt.QUESTION_TOKENS} tokens")
    with blas_threads(args.blas_threads):
        return _measure(args, model_dir)


def _measure(args, model_dir: Path) -> dict:
    eng = Engine(model_dir)
    n_ppl = args.ppl_seqs * args.ppl_len
    ids = heldout_ids(eng, model_dir, n_ppl + args.agree_prompts * AGREE_PROMPT)
    seqs = ids[:n_ppl].reshape(args.ppl_seqs, args.ppl_len)
    prompts = ids[n_ppl:].reshape(args.agree_prompts, AGREE_PROMPT)
    cont = greedy(eng, prompts, args.agree_steps)
    ref = None
    tiers = ["f32"] + [t for t in args.tiers if t != "f32"]
    items = {c: rt.oracle_items(args.items, c, args.per_doc) for c in args.contexts}
    result = {"model": str(model_dir), "blas_threads": args.blas_threads, "items": args.items, "per_doc": args.per_doc,
              "contexts": list(args.contexts), "ppl_tokens": args.ppl_seqs * (args.ppl_len - 1),
              "agreement_steps": args.agree_prompts * args.agree_steps, "tiers": {}}
    for tier in tiers:
        t0 = time.perf_counter()
        r = {"retrieval": {str(c): retrieval(eng, tier, items[c]) for c in args.contexts},
             "perplexity": perplexity(eng, tier, seqs)}
        logits = forced_logits(eng, tier, prompts, cont).astype(np.float64)
        if ref is None:
            ref = logits
        r["top1_agreement"] = float((logits.argmax(-1) == ref.argmax(-1)).mean())
        r["rel_logit_err"] = float(np.mean(np.linalg.norm(logits - ref, axis=-1) / np.linalg.norm(ref, axis=-1)))
        r["seconds"] = round(time.perf_counter() - t0, 1)
        result["tiers"][tier] = r
    return result


def render(res: dict) -> str:
    ctxs = [str(c) for c in res["contexts"]]
    f32 = res["tiers"]["f32"]
    lines = [f"kvfleet bench quality: {res['model']}; {res['items']} retrieval items per context, "
             f"perplexity over {res['ppl_tokens']} held-out tokens, agreement over "
             f"{res['agreement_steps']} greedy steps",
             f"{'tier':8s} " + " ".join(f"{'ret@' + c:>9s}" for c in ctxs) +
             f" {'ppl':>9s} {'ppl/f32':>8s} {'top1':>6s} {'rel_err':>8s} {'s':>6s}"]
    for name, t in res["tiers"].items():
        lines.append(f"{name:8s} " + " ".join(f"{t['retrieval'][c]:>6d}/{res['items']:<2d}" for c in ctxs)
                     + f" {t['perplexity']:9.3f} {t['perplexity'] / f32['perplexity']:8.4f}"
                     f" {t['top1_agreement']:6.3f} {t['rel_logit_err']:8.4f} {t['seconds']:6.1f}")
    return "\n".join(lines)
