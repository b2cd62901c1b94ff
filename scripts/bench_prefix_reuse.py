"""Time to first token with and without a saved prefix, in one run.

    python scripts/bench_prefix_reuse.py [--model DIR] [--kv f32] [--prompt-tokens 200]
                                         [--reps 5] [--max-tokens 4] [--format arrow]

One in-process worker with one slot (so requests do not share steps) and a KV cache dir in
a temp dir. A first pass saves the caches of `reps` prompts; then the measured pass runs,
alternating, each of those prompts again under a new cache name (cold: full prefill) and
under its saved name (warm: loads prompt_tokens - 1 tokens, computes one). Prints the
median and min TTFT of each and the prompt rows the model forwarded. Without --model it
uses the tiny checkpoint of scripts/make_tiny_model.py (the tests' model).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from cluster.requests import Request  # noqa: E402
from cluster.scheduler import Prepared, Scheduler  # noqa: E402
from workers.actor import LocalGroup, Worker, WorkerSpec  # noqa: E402


def tiny_model() -> Path:
    from scripts.make_tiny_model import make_tiny_model  # ROOT is on sys.path
    return make_tiny_model(Path(tempfile.mkdtemp(prefix="kvbench")) / "tiny", 0, ())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--kv", default="f32")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--format", default="arrow", choices=["arrow", "coli"])
    a = ap.parse_args()
    model = Path(a.model) if a.model else tiny_model()
    ctx = a.prompt_tokens + a.max_tokens + 16
    cache = tempfile.mkdtemp(prefix="kvcache")
    spec = WorkerSpec("w0", str(model), a.kv, 1, ctx, kv_cache_dir=cache,
                      kv_cache_format=a.format)
    worker = Worker(spec)
    forwarded: list[int] = []
    real = worker.model.forward
    worker.model.forward = lambda tokens, *x, **kw: (forwarded.append(len(tokens)), real(tokens, *x, **kw))[1]
    timers: dict[str, list[float]] = {"attach": [], "release": []}
    for name in timers:  # the worker's persistence calls, timed
        def timed(*x, _f=getattr(worker.persist, name), _t=timers[name], **kw):
            t0 = time.perf_counter()
            r = _f(*x, **kw)
            _t.append(time.perf_counter() - t0)
            return r
        setattr(worker.persist, name, timed)
    vocab = worker.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, vocab, a.prompt_tokens).astype(np.int32) for _ in range(a.reps)]

    def item(i: int, ids, cache_name: str) -> Prepared:
        return Prepared(Request(id=f"{cache_name}", line=i + 1), ids, a.max_tokens, 0.0, 1.0, 0,
                        cache=cache_name)

    def run(items) -> dict[str, tuple[float, int, list[int]]]:
        sched = Scheduler(LocalGroup([worker]), max_context=ctx, prefill_chunk=256, eos_ids=(),
                          decode=lambda ids: "", tier=a.kv)
        out = {}
        sched.run(items, lambda r: out.__setitem__(r.id, (r.ttft_s, r.cached_prompt_tokens,
                                                          r.completion_tokens)))
        return out

    run([item(0, prompts[0], "warmup")])  # first-call costs (imports, allocations)
    run([item(i, p, f"saved{i}") for i, p in enumerate(prompts)])
    forwarded.clear()
    for t in timers.values():
        t.clear()
    # one run per request: a request's release (its save: append + fsync) runs at the end of
    # its own run, not inside the next request's first step, whose TTFT it would join
    res = {}
    for i, p in enumerate(prompts):
        res.update(run([item(2 * i, p, f"cold{i}")]))
        res.update(run([item(2 * i + 1, p, f"saved{i}")]))
    cold = [res[f"cold{i}"] for i in range(a.reps)]
    warm = [res[f"saved{i}"] for i in range(a.reps)]
    same = all(c[2] == w[2] for c, w in zip(cold, warm))
    print(f"model {model.name}, tier {a.kv}, {a.format} files, prompt {a.prompt_tokens} tokens, "
          f"{a.reps} prompts, 1 slot; same completions cold vs warm: {same}")
    for label, rows in (("cold (full prefill)", cold), ("warm (saved prefix)", warm)):
        t = np.array([r[0] for r in rows]) * 1e3
        print(f"  {label:20s} TTFT median {np.median(t):7.1f} ms  min {t.min():7.1f} ms  "
              f"cached_prompt_tokens {sorted({r[1] for r in rows})}")
    print(f"  persistence on the worker: attach (lock, read, crc, match, copy into the pool) "
          f"median {1e3 * np.median(timers['attach'][1::2]):.1f} ms warm / "
          f"{1e3 * np.median(timers['attach'][0::2]):.1f} ms cold (new file); release median "
          f"{1e3 * np.median(timers['release'][0::2]):.1f} ms cold (append "
          f"{a.prompt_tokens + a.max_tokens - 1} rows, fsync) / "
          f"{1e3 * np.median(timers['release'][1::2]):.1f} ms warm (same tokens: no write); "
          f"each request runs alone, so its release is outside the next one's TTFT")
    print(f"  model forward rows in the measured pass: {sum(forwarded)} "
          f"(cold {a.reps}x{a.prompt_tokens + a.max_tokens - 1}, warm {a.reps}x{a.max_tokens})")


if __name__ == "__main__":
    main()
