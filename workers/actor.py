"""The worker: one device, one Model, one KVPool in the job's tier, and its slots.

The scheduler drives every worker with one call per step, `step(StepBatch) -> StepOutput`:
a flat token batch (prefill chunks and decode tokens of any of the worker's sequences,
mixed), the rows whose logits pick a next token, and the sequences to let go. The worker
maps the scheduler's sequence keys onto pool slots itself, so a step needs no other
round trip. The same class runs in-process (`LocalGroup`) or as a Ray actor (`RayGroup`).
"""
from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from workers.collect import StepHung, collect_steps
from workers.memstats import rss_bytes
from workers.persist import SlotPersist
from workers.sampling import sample_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    model: str  # repo-relative or absolute (cluster.config.JobConfig.model_ref)
    tier: str
    slots: int
    max_context: int
    block_size: int = 16
    kv_cache_dir: str | None = None  # save/resume sequences' KV there (workers/persist.py)
    kv_cache_format: str = "arrow"  # arrow | coli


@dataclass
class StepBatch:
    """One worker's share of a scheduler step. N token rows, M of them sampled."""
    keys: np.ndarray  # int64[N] sequence key of each token row
    tokens: np.ndarray  # int32[N]
    positions: np.ndarray  # int32[N]
    sample_at: np.ndarray  # int32[M] rows whose logits choose a next token
    temperature: np.ndarray  # float32[M] (0 = greedy)
    top_p: np.ndarray  # float32[M]
    seed: np.ndarray  # uint64[M]
    counter: np.ndarray  # uint64[M] index of the token being chosen within its sequence
    release: tuple[int, ...] = ()  # keys whose slots are freed before this step
    discard: tuple[int, ...] = ()  # of them, keys of failed sequences: KV not saved
    # the sequence of a sampled row ends with this step, and its slot is freed (KV saved) at
    # the step's end, when the row is `last` (max_tokens, the context end) or samples one of
    # `end_ids` (EOS); the ends the scheduler alone sees (stop strings) go in a later release
    last: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # bool[M] or empty
    end_ids: tuple[int, ...] = ()
    # key -> (cache name, int32 prompt ids): resume the sequence from its saved KV before
    # this step, which carries its first prompt chunk (workers/persist.py)
    attach: dict[int, tuple[str, np.ndarray]] = field(default_factory=dict)


@dataclass
class StepOutput:
    next_tokens: np.ndarray  # int32[M], in sample_at order
    forward_s: float  # time inside Model.forward
    step_s: float  # time of the whole step call on the worker
    kv_bytes: int  # pool.bytes_in_use() after the step
    fallbacks: dict[str, int] = field(default_factory=dict)  # path -> count in this step
    loaded: dict[int, int] = field(default_factory=dict)  # attached key -> prompt tokens loaded
    cache_events: dict[str, int] = field(default_factory=dict)  # persistence counts this step


class Worker:
    """Holds the model and the pool. `model`/`pool` may be injected (tests); otherwise they
    are loaded from the spec (workers.model.Model, kvstore.pool.KVPool)."""

    def __init__(self, spec: WorkerSpec, model: Any = None, pool: Any = None):
        self.spec = spec
        if model is None:
            from cluster.config import resolve_model
            from workers.model import Model
            model = Model.load(resolve_model(spec.model))
        if pool is None:
            from kvstore.pool import KVPool
            pool = KVPool.for_model(model.config, spec.tier, spec.slots, spec.max_context,
                                    block_size=spec.block_size)
        self.model, self.pool = model, pool
        self._slot: dict[int, int] = {}  # sequence key -> pool slot
        self._rebuilds = _rebuilds(self.pool)
        self.persist = SlotPersist.for_worker(spec, self.model, self.pool)

    def info(self) -> dict:
        return {"name": self.spec.name, "slots": self.spec.slots, "tier": self.spec.tier,
                "host": socket.gethostname(), "pid": os.getpid(), "device": "cpu"}

    def stats(self) -> dict:
        """Memory figures of this worker (the soak and `generate --stats` read them). A cpu
        worker's device memory is its resident set. Experts are replicated: the worker holds
        every routed expert, all in host memory (numpy), so each pick is served where it was
        made (hit rate 1, as workers/expert_shard.py defines it). The expert keys are
        ShardedWorker.stats()'s, which the expert gauges read (cluster/metrics.py)."""
        rss = rss_bytes()
        cfg = self.model.config
        held = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) * cfg.n_routed_experts
        return {"name": self.spec.name, "device": "cpu", "rss_bytes": rss,
                "device_mem_bytes": rss, "kv_bytes": int(self.pool.bytes_in_use()),
                "expert_pins": held, "expert_pins_device": 0, "expert_pins_host": held,
                "expert_hit_rate": 1.0 if held else None}

    def step(self, batch: StepBatch) -> StepOutput:
        t0 = time.perf_counter()
        self._free(batch.release, batch.discard)
        for key in np.unique(batch.keys).tolist():
            if key not in self._slot:
                self._slot[key] = self.pool.alloc_slot()
        loaded: dict[int, int] = {}
        if batch.attach:  # drops the prompt rows that the loaded prefixes cover
            batch, loaded = self.persist.attach(batch, self.pool, self._slot)
        uniq, inv = np.unique(batch.keys, return_inverse=True)
        slots = np.array([self._slot[k] for k in uniq.tolist()], np.int32)[inv]
        next_tokens = np.zeros(0, np.int32)
        forward_s = 0.0
        if len(batch.tokens):
            t1 = time.perf_counter()
            logits = self.model.forward(np.asarray(batch.tokens, np.int32), slots,
                                        np.asarray(batch.positions, np.int32), self.pool,
                                        logits_at=np.asarray(batch.sample_at, np.int64))
            forward_s = time.perf_counter() - t1
            self.persist.observe(batch)
            next_tokens = sample_rows(logits, batch.temperature, batch.top_p,
                                      batch.seed, batch.counter)
            ended = np.isin(next_tokens, batch.end_ids)
            if len(batch.last):
                ended |= batch.last
            if ended.any():  # their files unlocked before the scheduler hands out the results
                self._free(np.asarray(batch.keys)[np.asarray(batch.sample_at)[ended]].tolist())
        return StepOutput(next_tokens=next_tokens, forward_s=forward_s,
                          step_s=time.perf_counter() - t0, kv_bytes=int(self.pool.bytes_in_use()),
                          fallbacks=self._drain_fallbacks(), loaded=loaded,
                          cache_events=self.persist.drain_events())

    def _free(self, keys, discard=()) -> None:
        """Free the keys' slots, saving their KV first unless discarded. A key whose first
        step failed before it got a slot has nothing to free. A save that raises: the slot
        is freed all the same (and the rest released), then the step fails."""
        failed = None
        for key in keys:
            slot = self._slot.pop(int(key), None)
            if slot is not None:
                try:
                    self.persist.release(int(key), self.pool, slot, save=key not in discard)
                except Exception as e:
                    failed = failed or e
                self.pool.free_slot(slot)
        if failed is not None:
            raise failed

    def _drain_fallbacks(self) -> dict[str, int]:
        """Counts since the last step of native paths that fell back to a slower one: what
        the model reports (`model.drain_fallbacks()`, e.g. MLX ops on the CPU stream) and
        the polar rows the numpy consumers had to rebuild to float32."""
        drain = getattr(self.model, "drain_fallbacks", None)
        out = dict(drain()) if callable(drain) else {}
        now = _rebuilds(self.pool)
        if now > self._rebuilds:
            out["cpu.polar_rebuild_rows"] = now - self._rebuilds
        self._rebuilds = now
        return out


def _rebuilds(pool) -> int:
    """Polar rows this worker's pool rebuilt to float32 so far (0 for a pool without)."""
    counter = getattr(pool, "rebuilds", None)
    return counter.value if counter is not None else 0


class WorkerGroup(Protocol):
    """What the scheduler drives: named workers with slot capacities, stepped in lockstep.
    `step_all` returns, per worker, its StepOutput or the exception its step raised;
    `is_dead` says whether that exception means the worker is gone for good; `worker_stats`
    returns the stats() dict of each live worker (the scheduler's expert gauges read them).
    `dead_at_start`: the workers that died while loading, before any step; the group has
    recovered from them (capacity 0, never stepped) and the scheduler counts their deaths."""
    names: list[str]
    capacities: list[int]
    dead_at_start: list[int]

    def step_all(self, batches: dict[int, StepBatch]) -> dict[int, StepOutput | Exception]: ...

    def is_dead(self, worker: int, exc: BaseException) -> bool: ...

    def worker_stats(self) -> list[dict]: ...


def gather_stats(actors: list, names: list[str], dead, timeout_s: float = 30.0) -> list[dict]:
    """stats() of every actor not in `dead`, asked all at once; one that fails to answer
    within timeout_s (it died since its last step) is left out with a warning, so that the
    others' figures still come back (RayGroup, cluster/ep_group.py ShardedGroup)."""
    import ray
    refs = {i: actors[i].stats.remote() for i in range(len(actors)) if i not in dead}
    out = []
    deadline = time.monotonic() + timeout_s
    for i, ref in refs.items():
        try:
            out.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
        except ray.exceptions.RayError as e:
            why = str(e).strip().splitlines()
            log.warning("worker %s: stats unavailable: %s%s", names[i], type(e).__name__,
                        f": {why[0]}" if why else "")
    return out


class LocalGroup:
    """Workers in this process (tests, benchmarks, `workers.runtime: inprocess`)."""

    def __init__(self, workers: list[Worker]):
        self.workers = workers
        self.names = [w.spec.name for w in workers]
        self.capacities = [w.spec.slots for w in workers]
        self.dead_at_start: list[int] = []  # (an in-process worker cannot die apart from the job)

    def worker_stats(self) -> list[dict]:
        return [w.stats() for w in self.workers]

    @property
    def final_stats(self) -> list[dict]:
        return self.worker_stats()

    def step_all(self, batches: dict[int, StepBatch]) -> dict[int, StepOutput | Exception]:
        out: dict[int, StepOutput | Exception] = {}
        for i, b in batches.items():
            try:
                out[i] = self.workers[i].step(b)
            except Exception as e:  # handed to the scheduler, which fails that step's sequences
                out[i] = e
        return out

    def is_dead(self, worker: int, exc: BaseException) -> bool:
        return False  # an in-process worker cannot die apart from the job


class RayGroup:
    """Worker actors; a step submits to all of them first and then waits for all.

    The workers are independent and run one call at a time (a ping would wait behind the
    step), so a step still running `step_timeout_s` after it was submitted is hung whatever
    it is doing (workers/collect.py): its actor is killed and it counts as dead, so the
    scheduler re-runs its sequences on a worker that is left (or fails them where none is).
    The timeout is absolute, not a grace after the peers' steps end: a fleet mixes GPU and
    CPU hosts, and a CPU worker's step can rightly take far longer than a GPU worker's."""

    def __init__(self, placements: list[tuple[WorkerSpec, dict[str, Any]]],
                 start_timeout_s: float = 600.0, step_timeout_s: float | None = 600.0):
        """placements: (spec, Ray actor options: num_cpus, resources, label_selector...)."""
        import ray
        from cluster.ray_options import PLAIN_FIELDS, check_placeable
        # (an actor no node can host would keep the job waiting out start_timeout_s)
        check_placeable(ray, [(spec.name, opts) for spec, opts in placements], PLAIN_FIELDS)
        actor_cls = ray.remote(Worker)
        # named (as ShardedGroup's are), so that another driver can find and kill one on any
        # node: the soak's fault injector (cluster/soak/faults.py) kills a worker on another
        # node by name, and skipped unnamed ones, so it never killed a replicated one there
        tag = uuid.uuid4().hex[:6]
        self.actors = [actor_cls.options(name=f"kvfleet-{tag}-{spec.name.replace('/', '.')}",
                                         **opts).remote(spec) for spec, opts in placements]
        self.names = [spec.name for spec, _ in placements]
        self.capacities = [spec.slots for spec, _ in placements]
        self.step_timeout_s = step_timeout_s
        self.hung: set[int] = set()  # workers killed because a step of theirs hung
        self.dead: set[int] = set()  # those and the ones whose actor died under a step
        refs = [a.info.remote() for a in self.actors]
        self.info: list[dict | None] = []
        for name, ref in zip(self.names, refs):  # waits for the model loads
            try:
                self.info.append(ray.get(ref, timeout=start_timeout_s))
            except ray.exceptions.GetTimeoutError:  # an actor no node can host never starts
                self.close()
                raise RuntimeError(f"worker actors did not start within {start_timeout_s:.0f}s; "
                                   f"does a node offer what they ask for? "
                                   f"{[opts for _, opts in placements]}") from None
            except ray.exceptions.RayActorError as e:
                log.warning("worker %s died while starting: %s", name, str(e).splitlines()[0])
                self.info.append(None)
        if all(i is None for i in self.info):
            raise RuntimeError(f"all {len(self.actors)} worker actors died while starting")
        # died while loading: given no slots, so never stepped (a step would fail and re-queue
        # its sequences, or, given none, never find the death); the scheduler counts them
        self.dead_at_start = [i for i, info in enumerate(self.info) if info is None]
        for i in self.dead_at_start:
            self.capacities[i] = 0
            self.dead.add(i)

    def step_all(self, batches: dict[int, StepBatch]) -> dict[int, StepOutput | Exception]:
        import ray
        refs = {i: self.actors[i].step.remote(b) for i, b in batches.items()}
        out = collect_steps(ray, refs, {i: self.names[i] for i in refs}, math.inf,
                            timeout_s=self.step_timeout_s)  # (no grace: the timeout alone)
        for i, r in out.items():
            if isinstance(r, StepHung):
                log.error("%s; killing it", r)
                ray.kill(self.actors[i], no_restart=True)  # a hung one must not come back
                self.hung.add(i)
            if isinstance(r, (StepHung, ray.exceptions.RayActorError)):
                self.dead.add(i)
        return out

    def is_dead(self, worker: int, exc: BaseException) -> bool:
        import ray
        return worker in self.dead or isinstance(exc, ray.exceptions.RayActorError)

    def worker_stats(self, timeout_s: float = 30.0) -> list[dict]:
        """Worker.stats() of every worker not found dead by a step (gather_stats)."""
        return gather_stats(self.actors, self.names, self.dead, timeout_s)

    def close(self) -> None:
        """Collects the live workers' stats (final_stats), then kills the actors."""
        import ray
        self.final_stats = self.worker_stats()
        for a in self.actors:
            ray.kill(a)
