"""`kvfleet generate`: batch generation, prompts JSONL in, results Parquet out.

    kvfleet generate --prompts FILE.jsonl --out FILE.parquet [--config YAML] [--kv TIER]
                     [--slots N] [--max-tokens N] [--model DIR] [--workers N] [--inprocess]

Config: configs/generate.yaml (or --config) < environment (KV8, KV_TQ, KVFLEET_*) < flags.
With RAY_ADDRESS set (as under `ray job submit`) it joins that cluster, otherwise it starts
a local Ray; --inprocess runs without Ray. Rerunning with the same --out resumes.

Exit status (what `ray job submit` reports as SUCCEEDED or FAILED):
    0    every row finished (stop, length) or is an input error: a line that is not a valid
         request (bad JSON, an empty prompt, a token outside the vocabulary...) gets an
         error row, which is the data's fault, not the job's
    1    some rows failed at run time (a worker's step raised, or no live worker was left):
         they are in OUT as error rows and a rerun with the same --out runs them again; or
         the job itself crashed (a traceback)
    2    a usage error: a bad flag, file or config value (one line, no traceback)
    143  stopped by SIGTERM before it joined Ray (in-process, or while starting): the
         finished rows are kept for a rerun to resume. Once it has joined Ray, Ray's own
         driver handler ends it on SIGTERM with status 15, unwinding the same way.
    130  Ctrl-C (cluster/cli.py), the finished rows kept the same way.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from cluster.cli import Stopped, UsageError, stop_on_sigterm
from cluster.config import REPO_ROOT, load_job_config, warn_unknown_env
from kernels.tiers import TIERS

log = logging.getLogger(__name__)
DEFAULT_CONFIG = REPO_ROOT / "configs" / "generate.yaml"


def register(sub) -> None:
    p = sub.add_parser("generate", help="batch generation: prompts JSONL -> results Parquet")
    p.add_argument("--prompts", required=True, type=Path, help="JSONL, one request per line")
    p.add_argument("--out", required=True, type=Path, help="results Parquet (resumable)")
    p.add_argument("--config", type=Path, help=f"job config YAML (default {DEFAULT_CONFIG.name})")
    p.add_argument("--kv", choices=sorted(TIERS), help="KV cache tier")
    p.add_argument("--slots", type=int, help="KV slots per worker")
    p.add_argument("--max-tokens", type=int, help="default completion length")
    p.add_argument("--model", type=Path, help="model dir (config.json, weights, tokenizer)")
    p.add_argument("--workers", type=int, help="number of worker actors")
    p.add_argument("--inprocess", action="store_true", help="run the workers in this process")
    p.add_argument("--limit", type=int, help="process at most N prompts this run")
    p.add_argument("--stats", type=Path, help="also write the run's figures as JSON here "
                   "(scheduler counters, per-worker experts and memory; `kvfleet soak` reads it)")
    p.add_argument("--kv-cache-dir",  # (a str: Path("") is the cwd, which JobConfig cannot tell)
                   help="save each request's KV here and resume prompts that share a prefix")
    p.set_defaults(func=run, interrupted=interrupted)


def interrupted(args) -> str:
    """What a Ctrl-C leaves (cluster/cli.py prints it): the job's `finally` has flushed the
    finished rows to the part files, as on SIGTERM."""
    return f"the finished rows are kept (in {args.out}.parts); rerun with the same --out to resume"


def flag_overrides(args) -> dict:
    o: dict = {}
    if args.kv:
        o["kv"] = args.kv
    if args.slots is not None:
        o["slots"] = args.slots
    if args.max_tokens is not None:
        o.setdefault("sampling", {})["max_tokens"] = args.max_tokens
    if args.model is not None:
        o["model"] = str(args.model.resolve())
    if args.workers is not None:
        o.setdefault("workers", {})["count"] = args.workers
    if args.inprocess:
        o.setdefault("workers", {})["runtime"] = "inprocess"
    if args.kv_cache_dir is not None:
        o["kv_cache_dir"] = args.kv_cache_dir
    return o


def run(args) -> int:
    from cluster.jobs.generate import run_generate
    config = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    warn_unknown_env()
    cfg = load_job_config(config, overrides=flag_overrides(args))
    if not args.prompts.exists():
        raise UsageError(f"--prompts {args.prompts}: no such file")
    if args.limit is not None and args.limit < 0:
        raise UsageError(f"--limit {args.limit} must be >= 0")
    if args.stats is not None and args.stats.is_dir():  # (found only after the whole run)
        raise UsageError(f"--stats {args.stats}: is a directory; give the JSON file to write, "
                         f"e.g. {args.stats / 'stats.json'}")
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ:  # (under `ray job submit`)
        _warn_job_copy_paths(args, cfg)
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        summary = run_generate(cfg, args.prompts, args.out.resolve(), limit=args.limit)
    except Stopped:
        print(f"kvfleet generate: stopped by SIGTERM; the finished rows are kept (in "
              f"{args.out}.parts); rerun with the same --out to resume", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(summary.line())
    if args.stats is not None:
        write_stats(summary, cfg, args.stats)
    if summary.runtime_errors:  # (the job did not do its work: `ray job submit` says FAILED)
        print(f"kvfleet generate: {summary.runtime_errors} of {summary.done} rows failed at run "
              f"time (a worker's step raised or no live worker was left; see the log); they "
              f"are kept in {args.out} as error rows, and a rerun with the same --out runs "
              f"them again (every error row is redone, finished rows are skipped)",
              file=sys.stderr)
        return 1
    return 0


def _warn_job_copy_paths(args, cfg) -> None:
    """Paths that land in the job's copy of the working dir (the cwd under `ray job submit`):
    a temporary copy that Ray removes once unused (a later job shipping other files gets
    another), so what is written there is lost, or not found by the next job."""
    here = Path.cwd()
    if not args.out.is_absolute():
        log.warning("--out %s is relative: under `ray job submit` it lands in the job's copy "
                    "of the working dir (%s) on the head node; give an absolute path on "
                    "shared storage to keep it", args.out, here)
    d = cfg.kv_cache_dir  # (made absolute against the cwd: a relative one lies inside it)
    if d is not None and (d.is_relative_to(here) or d.resolve().is_relative_to(here.resolve())):
        log.warning("kv_cache_dir %s is relative or lies inside the job's copy of the working "
                    "dir (%s): under `ray job submit` that copy is temporary (Ray removes it "
                    "once unused; a later job shipping other files gets another), so the saved "
                    "KV is lost; give --kv-cache-dir, KVFLEET_KV_CACHE_DIR or `kv_cache_dir:` "
                    "an absolute path outside it, on storage that persists", d, here)


def write_stats(summary, cfg, path: Path) -> None:
    """The figures of one run as JSON: the scheduler's counters (SchedulerStats fields and
    its derived rates), the rows written, and the workers' own stats."""
    import dataclasses
    import json
    from cluster.atomic import write_atomic
    st = summary.stats
    doc = dict(dataclasses.asdict(st), tier=cfg.kv, rows=summary.done, errors=summary.errors,
               runtime_errors=summary.runtime_errors, skipped=summary.skipped,
               job_wall_s=summary.wall_s,
               decode_tokens_per_s=st.decode_tokens_per_s,
               overhead_per_decode_step_s=st.overhead_per_decode_step_s,
               workers=summary.workers)
    try:  # (atomic: a run killed mid-write leaves no truncated file for `kvfleet soak`)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(doc, indent=1, default=str).encode())
    except OSError as e:  # (the results are written by now: say so)
        raise UsageError(f"--stats {path}: cannot write it ({e.strerror}); the results are in "
                         f"{summary.out}") from None
