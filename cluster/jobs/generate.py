"""The `generate` job: prompts (JSONL) in, one Parquet row per input line out.

Flow: read and validate every line (bad lines become error rows at once) -> skip keys that
an earlier run of the same OUT finished -> start or join Ray and place the worker actors
(or build in-process workers) -> the scheduler runs the rest, each result going to the
crash-safe ResultStore -> merge into OUT.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import JobConfig, JobConfigError
from cluster.jobs.progress import Progress
from cluster.jobs.results_store import ResultStore
from cluster.metrics import JobMetrics
from cluster.requests import (InputError, Request, Result, read_requests, request_digest,
                              result_key)
from cluster.scheduler import Prepared, Scheduler, SchedulerStats
from workers.actor import LocalGroup, RayGroup, Worker, WorkerSpec
from workers.persist import unsupported_reason

log = logging.getLogger(__name__)


@dataclass
class Summary:
    out: Path
    done: int  # rows written by this run
    errors: int  # of which error rows
    runtime_errors: int  # of which made at run time (a worker's step raised, no live worker
    # was left), not from the input line: the job failed to serve them (exit status 1)
    skipped: int  # keys an earlier run finished
    tokens: int
    wall_s: float
    stats: SchedulerStats
    workers: list[dict] = field(default_factory=list)  # per-worker stats at the end, where
    # the group keeps them (cluster/ep_group.py: experts held, hit rate, RSS, device memory)

    def line(self) -> str:
        tps = self.stats.tokens / self.stats.wall_s if self.stats.wall_s else 0.0
        return (f"{self.done} rows ({self.errors} errors, {self.runtime_errors} of them at run "
                f"time, {self.skipped} skipped as done) -> "
                f"{self.out}; {self.tokens} tokens in {self.wall_s:.1f}s, {tps:.1f} tok/s in "
                f"steps, scheduler overhead {1e3 * self.stats.overhead_per_decode_step_s:.2f} "
                f"ms per decode step")


def run_generate(cfg: JobConfig, prompts: str | Path, out: str | Path, *,
                 limit: int | None = None, progress: bool | None = None) -> Summary:
    """`limit` = admit at most that many runnable prompts (the rest waits for a rerun)."""
    t0 = time.perf_counter()
    from workers.config import ConfigError, ModelConfig
    from workers.safetensors_io import WeightsError
    from workers.tokenizer import Tokenizer, TokenizerError
    from workers.weights import check_checkpoint
    if not (cfg.model / "config.json").exists():
        raise JobConfigError(f"model: {cfg.model} has no config.json (set `model:` in the "
                             f"config, --model, or KVFLEET_MODEL)")
    try:  # (both name the file)
        mcfg = ModelConfig.from_file(cfg.model / "config.json")
        tok = Tokenizer.from_dir(cfg.model)
    except (ConfigError, TokenizerError) as e:
        raise JobConfigError(f"model: {e}") from None
    from kernels.tiers import get_tier
    if why := get_tier(cfg.kv).width_error(mcfg.kv_lora_rank, mcfg.qk_rope_head_dim):
        # (else every worker's KV pool refuses it, one traceback each; a fleet's placement
        # says the same, this covers the jobs without a fleet)
        raise JobConfigError(f"kv={cfg.kv} (--kv, KVFLEET_KV, KV_TQ): {why} "
                             f"({cfg.model / 'config.json'})")
    if cfg.max_context > mcfg.max_position_embeddings:  # (as `kvfleet plan` warns; vLLM refuses)
        log.warning("max_context=%d exceeds the model's max_position_embeddings %d (%s): "
                    "positions past it are ones the model was not trained at", cfg.max_context,
                    mcfg.max_position_embeddings, cfg.model / "config.json")
    if cfg.kv_cache_dir is not None and (why := unsupported_reason(mcfg)):
        raise JobConfigError(f"model {cfg.model}: {why}")
    if cfg.kv_cache_dir is not None and (why := _dir_error(cfg.kv_cache_dir)):
        # (the workers would fail to create it, each with a traceback of its own)
        raise JobConfigError(f"kv_cache_dir {cfg.kv_cache_dir}: {why} (set by --kv-cache-dir, "
                             f"KVFLEET_KV_CACHE_DIR or `kv_cache_dir:`)")
    if cfg.workers.runtime == "ray" and not any(cfg.model.glob("*.safetensors")):
        # (a driver on a head node with config.json and the tokenizer only: the weights are
        # on the workers' nodes, which load their own copy, as before this check existed)
        log.warning("model: %s has no weights on this host: not checked before the workers "
                    "start (each checks its own copy as it loads)", cfg.model)
    else:
        try:  # the weights' headers (no tensor data): a missing, truncated or mismatched
            # checkpoint ended every worker's start with a traceback of its own (exit 1)
            check_checkpoint(cfg.model, mcfg)
        except WeightsError as e:  # (names the file)
            raise JobConfigError(f"model: {e}") from None
    store = ResultStore(out, flush_every=cfg.flush_every, settings=_settings(cfg))
    try:  # (the store locks OUT for this run: let go of it however the run ends)
        return _generate(cfg, prompts, out, store, tok, mcfg, t0, limit, progress)
    finally:
        store.close()


def _generate(cfg: JobConfig, prompts, out, store: ResultStore, tok, mcfg, t0: float,
              limit: int | None, progress: bool | None) -> Summary:
    done = store.done_keys()
    skipped, errors, items, changed = 0, [], [], []
    try:
        lines = list(read_requests(prompts))
    except OSError as e:
        raise JobConfigError(f"--prompts {prompts}: {e.strerror}") from None
    keys = {result_key(item.id, item.line) for item in lines}
    if done and not keys & done.keys():
        # finalize keeps only the current lines' rows: an empty prompts file (a failed
        # download, a `>` for a `>>`) or another batch's wiped every finished row, exit 0
        raise JobConfigError(
            f"--out {out}: holds {len(done)} finished rows (ids e.g. {sorted(done)[:3]}), none "
            f"for a line of --prompts {prompts} ({len(lines)} requests"
            f"{', ids e.g. ' + str(sorted(keys)[:3]) if keys else ''}): this run would "
            f"leave none of them. Give another --out, or move {out} away to start over")
    for item in lines:
        key = result_key(item.id, item.line)
        if key in done:
            digest = request_digest(item) if isinstance(item, Request) else None
            if done[key] is None or done[key] == digest:
                skipped += 1
                continue
            changed.append(key)
        p = item if isinstance(item, InputError) else _prepare(item, cfg, tok, mcfg.vocab_size)
        (errors if isinstance(p, InputError) else items).append(p)
    if limit is not None:
        items = items[:limit]
    if not lines:
        log.warning("--prompts %s: no requests in it (an empty or blank file): nothing to run",
                    prompts)
    if skipped:
        log.info("%s: %d prompts already done, skipping them", out, skipped)
    if changed:
        log.warning("%s: %d ids have rows made for another prompt or per-line settings than "
                    "their line has now (e.g. %s): run again", out, len(changed), changed[:3])
    if cfg.kv_cache_dir is None and any(p.req.cache is not None for p in items):
        log.warning("%s: 'cache' fields are ignored: KV cache persistence is off (set "
                    "kv_cache_dir, KVFLEET_KV_CACHE_DIR or --kv-cache-dir)", prompts)
    bar = Progress(len(errors) + len(items), cfg.progress_every_s, tty=progress)
    written = {"n": 0, "errors": 0, "runtime": 0}

    def emit(r: Result) -> None:
        store.add(r)
        written["n"] += 1
        written["errors"] += r.finish_reason == "error"
        written["runtime"] += r.runtime_error
        bar.update(r.completion_token_count)

    for bad in errors:
        emit(Result.failed(bad, cfg.kv))
    stats = SchedulerStats()
    group = None
    if items:
        group, close = _start_workers(cfg)
        bar.started()
        try:  # a group that keeps metrics (cluster/ep_group.py) shares them
            sched = Scheduler(group, max_context=cfg.max_context,
                              prefill_chunk=cfg.prefill_chunk, eos_ids=_eos(tok, mcfg),
                              decode=tok.decode, tier=cfg.kv,
                              metrics=getattr(group, "metrics", None)
                              or JobMetrics(use_ray=cfg.workers.runtime == "ray"))
            stats = sched.run(items, emit)
        finally:
            store.flush()
            close()
    bar.close()
    store.finalize({result_key(item.id, item.line): item.line for item in lines})
    if stats.kv_cache:
        log.info("KV cache %s: %s", cfg.kv_cache_dir,
                 ", ".join(f"{k} {v}" for k, v in sorted(stats.kv_cache.items())))
    s = Summary(Path(out), written["n"], written["errors"], written["runtime"], skipped,
                stats.tokens, time.perf_counter() - t0, stats,
                list(getattr(group, "final_stats", [])))
    log.info("generate: %s", s.line())
    return s


def _dir_error(d: Path) -> str | None:
    """Why `os.makedirs(d, exist_ok=True)` (kvstore/slots.py, on each worker) fails on this
    host because of what is on the way, else None."""
    up = d
    while not os.path.lexists(up) and up != up.parent:
        up = up.parent
    if up.is_dir():
        return None
    if up == d:
        return "exists and is not a directory"
    return f"cannot be made: {up} is not a directory (a file, or a link that does not resolve)"


def _settings(cfg: JobConfig) -> dict[str, object]:
    """What makes two runs' rows comparable (ResultStore refuses to mix them in one OUT)."""
    return {"kv": cfg.kv, "model": cfg.model_ref(), "max_context": cfg.max_context,
            "sampling": cfg.sampling.model_dump()}


def _prepare(r: Request, cfg: JobConfig, tok, vocab: int) -> Prepared | InputError:
    def bad(why: str) -> InputError:
        return InputError(r.line, f"line {r.line}: {why}", r.id, r.prompt)

    ids = np.asarray(r.prompt_tokens if r.prompt_tokens is not None else tok.encode_prompt(r.prompt),
                     np.int64)
    if ids.size == 0:
        return bad("empty prompt (no tokens after tokenization)")
    if ids.max() >= vocab:
        return bad(f"prompt token {int(ids.max())} is outside the vocabulary ({vocab})")
    if ids.size > cfg.max_context:
        return bad(f"prompt of {ids.size} tokens is longer than the context "
                   f"(max_context={cfg.max_context})")
    d = cfg.sampling
    return Prepared(r, ids.astype(np.int32),
                    max_tokens=r.max_tokens if r.max_tokens is not None else d.max_tokens,
                    temperature=r.temperature if r.temperature is not None else d.temperature,
                    top_p=r.top_p if r.top_p is not None else d.top_p,
                    seed=r.seed if r.seed is not None else request_seed(d.seed, result_key(r.id, r.line)),
                    stop=r.stop,
                    cache=None if cfg.kv_cache_dir is None else r.cache or r.id)


def request_seed(job_seed: int, key: str) -> int:
    """The seed of a request that gives none: the job's `sampling.seed` mixed with the
    request's row key (its id, else its line), so that sampled requests draw different
    tokens (vLLM gives every request its own) while a rerun, or a re-run after a worker
    died, draws the same ones. (Every such request used the job's seed itself: the same
    prompt twice gave the same completion, and all requests shared their draws.)"""
    h = hashlib.blake2b(key.encode("utf-8"), digest_size=8, key=int(job_seed).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def _eos(tok, mcfg) -> set[int]:
    return set(tok.eos_ids) | set(mcfg.eos_token_ids)


# -- workers ----------------------------------------------------------------------------
def _unused_step_timeout(cfg: JobConfig, why: str) -> None:
    """A step_timeout_s other than the default, given to workers that have no step timeout:
    say that it does nothing rather than let it look applied."""
    from cluster.config import Workers
    if cfg.workers.step_timeout_s != Workers.model_fields["step_timeout_s"].default:
        log.warning("workers.step_timeout_s=%s is not used: %s", cfg.workers.step_timeout_s, why)


def worker_placements(cfg: JobConfig) -> list[tuple[WorkerSpec, dict[str, Any]]]:
    """One (spec, Ray actor options) per worker, as cluster/placement.py places them:
    `workers.count` alike CPU workers, or one per device of the fleet file, by custom
    resources and labels (a CUDA device adds num_gpus=1 only together with those)."""
    from cluster.placement import fleet_placements
    return [(p.spec, p.options) for p in fleet_placements(cfg)]


def _start_workers(cfg: JobConfig):
    if cfg.workers.experts == "sharded" or (cfg.workers.fleet and cfg.workers.runtime == "ray"):
        from cluster.ep_group import start_group  # expert parallel / heterogeneous fleet
        _unused_step_timeout(cfg, "expert-parallel / fleet workers find a hung one by pinging "
                                  "a step still running 60 s after it began or after a "
                                  "peer's step failed (cluster/ep_group.py)")
        return start_group(cfg)
    placements = worker_placements(cfg)
    if cfg.workers.runtime == "inprocess":
        _unused_step_timeout(cfg, "in-process workers run in the job's own process")
        return LocalGroup([Worker(spec) for spec, _ in placements]), lambda: None
    import ray
    started = connect_ray(cfg, placements)
    group = RayGroup(placements, step_timeout_s=cfg.workers.step_timeout_s)

    def close() -> None:
        group.close()
        if started:
            ray.shutdown()
    return group, close


def local_cpus(cfg: JobConfig, placements=()) -> int:
    """CPUs of the local Ray a job starts: the machine's, or more where the workers ask for
    more (Ray would otherwise wait for them forever: CPUs are logical, the workers share the
    cores); workers.ray_num_cpus when set, which must cover them."""
    need = math.ceil(sum(opts.get("num_cpus", 1.0) for _, opts in placements))
    if cfg.workers.ray_num_cpus is not None:
        if cfg.workers.ray_num_cpus < need:
            raise JobConfigError(f"workers.ray_num_cpus={cfg.workers.ray_num_cpus} is fewer "
                                 f"than the {need} CPUs the {len(placements)} workers ask for "
                                 f"(workers.num_cpus each)")
        return cfg.workers.ray_num_cpus
    return max(os.cpu_count() or 1, need)


def connect_ray(cfg: JobConfig, placements=()) -> bool:
    """Join the cluster RAY_ADDRESS names, or start a local Ray that offers the custom
    resources the workers ask for. True if this call connected (and so must disconnect)."""
    import ray
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        log.info("joining the Ray cluster at %s", address)
        ray.init(address=address)
        return True  # disconnects this driver only; the cluster stays up
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        log.info("RAY_AUTH_MODE was unset: set to 'disabled' for the local Ray this job starts")
    n = local_cpus(cfg, placements)
    resources: dict[str, float] = {}
    for _, opts in placements:
        for k, v in opts.get("resources", {}).items():
            resources[k] = resources.get(k, 0.0) + v
    log.info("no RAY_ADDRESS: starting a local Ray with %d CPUs%s", n,
             f" and resources {resources}" if resources else "")
    # address="local": a new Ray of our own, even where `ray start` left a cluster running
    ray.init(address="local", num_cpus=n, resources=resources or None, include_dashboard=False)
    return True
