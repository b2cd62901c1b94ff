"""Generation throughput and scheduler overhead, slots=1 against slots=8, in one run.

    python scripts/bench_generate.py [--model DIR] [--kv f32] [--prompts 16] [--max-tokens 32]
                                     [--slots 1,8] [--ray]

Runs the same greedy workload (random prompts of 8..64 tokens) through the real scheduler
and worker with each slot count and prints, per run: generated tokens per second over the
whole run, decode tokens per second, and per decode step the model's forward time and the
time outside it (scheduler + worker sampling/slot mapping [+ Ray round trip with --ray]),
of which the scheduler's own Python. Without --model it uses models/kvfleet-mini when
present, else a tiny checkpoint from scripts/make_tiny_model.py.

On a shared, loaded machine compare like with like: a Ray actor with num_cpus=1 runs with
OMP_NUM_THREADS=1 in its own session (Linux autogroup scheduling gives each session an
equal CPU share), so run the in-process side the same way:
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 setsid -w python scripts/bench_generate.py --ray
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
from cluster.config import DEFAULT_MODEL  # noqa: E402
from cluster.requests import Request  # noqa: E402
from cluster.scheduler import Prepared, Scheduler  # noqa: E402
from workers.actor import LocalGroup, RayGroup, Worker, WorkerSpec  # noqa: E402


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if (DEFAULT_MODEL / "config.json").exists():
        return DEFAULT_MODEL
    from scripts.make_tiny_model import make_tiny_model  # ROOT is on sys.path
    return make_tiny_model(Path(tempfile.mkdtemp(prefix="kvbench")) / "tiny", 0, ())


def workload(n: int, max_tokens: int, vocab: int, seed: int = 0) -> list[Prepared]:
    rng = np.random.default_rng(seed)
    return [Prepared(Request(id=f"b{i}", line=i + 1),
                     rng.integers(5, vocab, size=int(rng.integers(8, 65))).astype(np.int32),
                     max_tokens, 0.0, 1.0, 0) for i in range(n)]


def run(group, items, tier, max_ctx, eos):
    # EOS off (empty set): every request decodes exactly max_tokens, so runs compare
    sched = Scheduler(group, max_context=max_ctx, prefill_chunk=256, eos_ids=eos,
                      decode=lambda ids: "", tier=tier)
    t0 = time.perf_counter()
    stats = sched.run(items, lambda r: None)
    return stats, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--kv", default="f32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", default="1,8")
    ap.add_argument("--ray", action="store_true", help="also run through a Ray worker actor")
    args = ap.parse_args()
    from workers.model import Model
    d = model_dir(args.model)
    model = Model.load(d)
    max_ctx = 64 + args.max_tokens + 16
    items = workload(args.prompts, args.max_tokens, model.config.vocab_size)
    print(f"model {d} ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
          f"{model.config.n_routed_experts} experts), kv {args.kv}, {args.prompts} prompts x "
          f"{args.max_tokens} tokens, greedy")
    runtimes = ["inprocess"] + (["ray"] if args.ray else [])
    print(f"{'runtime':>9} {'slots':>5} {'tok/s':>8} {'decode tok/s':>12} {'steps':>6} "
          f"{'fwd ms/step':>11} {'other ms/step':>13} {'sched ms/step':>13}")
    for runtime in runtimes:
        for slots in [int(s) for s in args.slots.split(",")]:
            spec = WorkerSpec("w0", str(d), args.kv, slots, max_ctx)
            if runtime == "inprocess":
                group = LocalGroup([Worker(spec, model=model)])
            else:
                import ray
                if not ray.is_initialized():
                    ray.init(address="local", num_cpus=2, include_dashboard=False)
                group = RayGroup([(spec, {"num_cpus": 1})])
            run(group, items[:2], args.kv, max_ctx, ())  # warm-up
            st, wall = run(group, items, args.kv, max_ctx, ())
            steps = max(st.decode_steps, 1)
            print(f"{runtime:>9} {slots:>5} {st.tokens / wall:>8.1f} {st.decode_tokens_per_s:>12.1f} "
                  f"{st.decode_steps:>6} {1e3 * st.decode_forward_s / steps:>11.2f} "
                  f"{1e3 * st.overhead_per_decode_step_s:>13.3f} "
                  f"{1e3 * st.decode_driver_s / steps:>13.3f}")
            if runtime == "ray":
                group.close()


if __name__ == "__main__":
    main()
