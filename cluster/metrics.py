"""Job metrics, exported through ray.util.metrics (Prometheus via the Ray metrics agent).

    kvfleet_tokens_generated          Counter    tokens sampled (EOS included): a work rate, so
                                                 the tokens of a sequence re-run after its worker
                                                 died count again when re-sampled (the job's
                                                 SchedulerStats.tokens counts each delivered token
                                                 once)
    kvfleet_tokens_rerun              Counter    of those, tokens lost with a dead worker's KV
                                                 (SchedulerStats.rerun_tokens): generated minus
                                                 rerun is the tokens delivered
    kvfleet_decode_tokens_per_s       Gauge      tokens of the last decode-only step / its wall
                                                 time (steps with prefill rows leave it)
    kvfleet_time_to_first_token_s     Histogram  admission -> first sampled token
    kvfleet_queue_depth               Gauge      requests waiting for a slot
    kvfleet_active_slots              Gauge      sequences holding a slot
    kvfleet_kv_bytes_in_use           Gauge      tags tier, device (the worker)
    kvfleet_fallbacks                 Counter    tag path: a native path that fell back (e.g.
                                                 cpu.polar_rebuild_rows, cuda.attend_polar3,
                                                 cuda.host_model_steps: a cuda worker on numpy;
                                                 every path: workers/fallbacks.py)
    kvfleet_expert_pins               Gauge      tag device: routed experts the worker holds
    kvfleet_expert_pins_host          Gauge      tag device: of those, held in host memory (all
                                                 of a cpu or metal worker's; a cuda worker's
                                                 that the plan does not pin on its GPU)
    kvfleet_expert_hit_rate           Gauge      tag device: share of its routed picks served
                                                 by its own shard (workers/expert_shard.py)
                                                 (the three expert gauges: WorkerGauges, every
                                                 5 s and at the end of a run, for any group)
    kvfleet_worker_deaths             Counter    workers found dead during the job
    kvfleet_experts_moved             Counter    routed experts re-assigned after deaths
    kvfleet_requests_requeued         Counter    sequences re-run because their worker died
    kvfleet_kv_cache                  Counter    tag event: saved-KV counts (workers/persist.py:
                                                 hits, misses, busy, rejected, upgraded,
                                                 loaded_tokens, saved_tokens, truncated, ...)

Without Ray (in-process runs, tests) the same calls update `JobMetrics.local`, a plain
dict that tests read; with `enabled=False` they do nothing.

Gauges are kept alive. Ray's metrics agent drops a gauge series about twice its report
interval (~20 s) after its last set, and most of these are set only on events: a step (a
single step can take longer: a long prefill, a stuck worker found dead after a timeout),
a decode-only step (the decode rate, through a long run of prefill steps), a stats pull
(the expert gauges, after a step). So while a Scheduler runs (`JobMetrics.keep_alive`) a
thread sets again, every `refresh_s` (5 s), each gauge series that nothing set in that
time, to its last value; a series of a worker found dead is dropped from that (`forget`),
so it ages out of the dashboard as the worker did (KeptGauges, which the soak's ratio
gauge uses too). The cost: one dict entry per series
(3 + 4 per worker), a lock per set, and a thread that wakes every 5 s and sets only the
series the steps left alone (none in a busy job).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

TTFT_BOUNDARIES = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class KeptGauges:
    """Gauge series set again while they matter (see the module docstring): `set` sets a
    series and keeps its last value; `refresh` sets again each one not set in the last
    refresh_s; `running()` (a context) or `start`/`stop` run a thread that refreshes every
    refresh_s; `forget` drops the series with a tag's value. Used by JobMetrics and by the
    soak's ratio gauge (cluster/soak/runner.py)."""

    def __init__(self, refresh_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.refresh_s, self.clock = refresh_s, clock
        # every series set: (gauge, tags) -> [last value, clock() when set]
        self._kept: dict[tuple[Any, tuple], list[float]] = {}
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def set(self, gauge: Any, value: float, **tags: str) -> None:
        with self._lock:
            self._set(gauge, tuple(sorted(tags.items())), value)

    def _set(self, gauge: Any, tags: tuple, value: float) -> None:
        gauge.set(value, tags=dict(tags) or None)
        self._kept[(gauge, tags)] = [value, self.clock()]

    def refresh(self) -> int:
        """Set again every series not set in the last refresh_s, to its last value; returns
        how many were."""
        with self._lock:
            now, n = self.clock(), 0
            for (gauge, tags), (value, at) in list(self._kept.items()):
                if now - at >= self.refresh_s:
                    self._set(gauge, tags, value)
                    n += 1
            return n

    def forget(self, tag: str, value: str) -> None:
        with self._lock:
            for series in [s for s in self._kept if (tag, value) in s[1]]:
                del self._kept[series]

    def start(self, name: str = "kvfleet-gauges") -> None:
        self._stop = stop = threading.Event()

        def keep():
            while not stop.wait(self.refresh_s):
                self.refresh()
        self._thread = threading.Thread(target=keep, daemon=True, name=name)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()


class JobMetrics:
    """backend: what makes the metrics (Counter, Gauge, Histogram), ray.util.metrics when
    Ray is used (use_ray, or None: Ray is up); tests pass their own. refresh_s, clock: the
    keep-alive's interval and clock (see the module docstring)."""

    def __init__(self, enabled: bool = True, use_ray: bool | None = None, backend: Any = None,
                 refresh_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self.local: dict[str, float] = defaultdict(float)
        self._ray = None
        self.kept = KeptGauges(refresh_s, clock)
        if not enabled:
            return
        if backend is None and use_ray is None:
            import ray
            use_ray = ray.is_initialized()
        if backend is not None or use_ray:
            if backend is None:
                from ray.util import metrics as backend
            m = backend
            self._ray = {
                "tokens": m.Counter("kvfleet_tokens_generated", "tokens sampled"),
                "rerun": m.Counter("kvfleet_tokens_rerun", "tokens lost with a dead worker"),
                "tps": m.Gauge("kvfleet_decode_tokens_per_s", "tokens per second, last decode step"),
                "ttft": m.Histogram("kvfleet_time_to_first_token_s", "admission to first token",
                                    boundaries=TTFT_BOUNDARIES),
                "queue": m.Gauge("kvfleet_queue_depth", "requests waiting for a slot"),
                "active": m.Gauge("kvfleet_active_slots", "sequences holding a slot"),
                "kv": m.Gauge("kvfleet_kv_bytes_in_use", "KV pool bytes held",
                              tag_keys=("tier", "device")),
                "fallbacks": m.Counter("kvfleet_fallbacks", "native paths that fell back",
                                       tag_keys=("path",)),
                "pins": m.Gauge("kvfleet_expert_pins", "routed experts held by the worker",
                                tag_keys=("device",)),
                "pins_host": m.Gauge("kvfleet_expert_pins_host", "routed experts held in host memory",
                                     tag_keys=("device",)),
                "hit": m.Gauge("kvfleet_expert_hit_rate", "share of routed picks served locally",
                               tag_keys=("device",)),
                "deaths": m.Counter("kvfleet_worker_deaths", "workers found dead"),
                "moved": m.Counter("kvfleet_experts_moved", "experts re-assigned after deaths"),
                "requeued": m.Counter("kvfleet_requests_requeued", "sequences re-run elsewhere"),
                "kv_cache": m.Counter("kvfleet_kv_cache", "saved-KV events and token counts",
                                      tag_keys=("event",)),
            }
            # A counter's series appears at its first increment, so Prometheus's increase()
            # and rate() miss that first step (a job's only worker death read as 0): the
            # untagged counters start on the endpoint at 0. (Counter.inc refuses 0; _record
            # is what it calls.)
            for k in ("tokens", "rerun", "deaths", "moved", "requeued"):
                record = getattr(self._ray[k], "_record", None)
                if record is not None:
                    record(0)
            # (and the tagged ones' known tags: the saved-KV events and the fallback paths
            # are fixed names, so their series start at 0 too)
            from workers.fallbacks import FALLBACK_PATHS
            from workers.persist import CACHE_EVENTS
            for k, tag, values in (("kv_cache", "event", CACHE_EVENTS),
                                   ("fallbacks", "path", FALLBACK_PATHS)):
                record = getattr(self._ray[k], "_record", None)
                if record is not None:
                    for value in values:
                        record(0, tags={tag: value})

    # -- gauges, kept alive (KeptGauges) ------------------------------------------------
    def _gauge(self, key: str, value: float, **tags: str) -> None:
        self.kept.set(self._ray[key], value, **tags)

    def refresh(self) -> int:
        """KeptGauges.refresh: the series set again."""
        return self.kept.refresh()

    def forget(self, device: str) -> None:
        """A worker found dead: its series (tag device) are no longer kept alive."""
        self.kept.forget("device", device)

    def keep_alive(self) -> contextlib.AbstractContextManager:
        """While inside, a thread calls refresh() every refresh_s (nothing without Ray)."""
        return self.kept.running() if self._ray else contextlib.nullcontext()

    # -- what the scheduler reports -------------------------------------------------------
    def queue(self, waiting: int, active: int) -> None:
        if not self.enabled:
            return
        self.local["queue_depth"] = waiting
        self.local["active_slots"] = active
        if self._ray:
            self._gauge("queue", waiting)
            self._gauge("active", active)

    def step(self, tokens: int, wall_s: float, decode: bool = True) -> None:
        """A step's sampled tokens; the decode rate gauge follows decode-only steps (a step
        with prefill rows samples few tokens in a long step: it is not a decode rate)."""
        if not self.enabled:
            return
        self.local["tokens_generated"] += tokens
        rate = tokens / wall_s if wall_s > 0 else 0.0
        if decode:
            self.local["decode_tokens_per_s"] = rate
        if self._ray:
            if tokens:
                self._ray["tokens"].inc(tokens)
            if decode:
                self._gauge("tps", rate)

    def ttft(self, seconds: float) -> None:
        if not self.enabled:
            return
        self.local["ttft_count"] += 1
        self.local["ttft_sum_s"] += seconds
        if self._ray:
            self._ray["ttft"].observe(seconds)

    def kv_bytes(self, tier: str, device: str, n: int) -> None:
        if not self.enabled:
            return
        self.local[f"kv_bytes_in_use[{tier},{device}]"] = n
        if self._ray:
            self._gauge("kv", n, tier=tier, device=device)

    def fallback(self, path: str, n: int = 1) -> None:
        if not self.enabled or n <= 0:
            return
        self.local[f"fallbacks[{path}]"] += n
        if self._ray:
            self._ray["fallbacks"].inc(n, tags={"path": path})

    def expert_stats(self, device: str, pins: int, hit_rate: float | None, pins_host: int) -> None:
        if not self.enabled:
            return
        self.local[f"expert_pins[{device}]"] = pins
        self.local[f"expert_pins_host[{device}]"] = pins_host
        if hit_rate is not None:
            self.local[f"expert_hit_rate[{device}]"] = hit_rate
        if self._ray:
            self._gauge("pins", pins, device=device)
            self._gauge("pins_host", pins_host, device=device)
            if hit_rate is not None:
                self._gauge("hit", hit_rate, device=device)

    def worker_died(self, requeued: int, lost_tokens: int = 0) -> None:
        """A worker found dead; `requeued` of its sequences go back to the queue, and the
        `lost_tokens` they had sampled died with its KV."""
        if not self.enabled:
            return
        self.local["worker_deaths"] += 1
        self.local["requests_requeued"] += requeued
        self.local["tokens_rerun"] += lost_tokens
        if self._ray:
            self._ray["deaths"].inc(1)
            if requeued:
                self._ray["requeued"].inc(requeued)
            if lost_tokens:
                self._ray["rerun"].inc(lost_tokens)

    def experts_moved(self, n: int) -> None:
        if not self.enabled or n <= 0:
            return
        self.local["experts_moved"] += n
        if self._ray:
            self._ray["moved"].inc(n)

    def kv_cache(self, event: str, n: int) -> None:
        if not self.enabled or n <= 0:
            return
        self.local[f"kv_cache[{event}]"] += n
        if self._ray:
            self._ray["kv_cache"].inc(n, tags={"event": event})


class WorkerGauges:
    """The expert gauges (kvfleet_expert_pins, _pins_host, _hit_rate) of every live worker,
    from its stats() dict (workers/actor.py Worker.stats, workers/ep_worker.py): `tick()`
    sets them at most every `every_s` seconds (the first call always), `close()` once more.
    The scheduler drives one for any worker group (cluster/scheduler.py). The figures are
    pulled, one stats call per worker, rather than sent with every step: a step's output
    stays what the step needs, and the gauges cost one round trip per interval.

    `stats` returns the live workers' dicts. Where it raises (a worker that died since its
    last step, a stats call that failed) the gauges keep their last values, a warning says
    why, and the job goes on: the gauges are a side channel and never fail the job."""

    def __init__(self, metrics: JobMetrics, stats: Callable[[], list[dict]], every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics, self.stats, self.every_s, self.clock = metrics, stats, every_s, clock
        self._last: float | None = None

    def tick(self) -> None:
        if not self.metrics.enabled:
            return  # (no stats call at all)
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            return
        self._last = now
        self._update()

    def close(self) -> None:
        if self.metrics.enabled:
            self._update()

    def _update(self) -> None:
        try:
            stats = self.stats()
        except Exception as e:  # whatever failed, the job must not (see the class docstring)
            log.warning("worker stats unavailable, the expert gauges keep their last values: %r", e)
            return
        for s in stats:
            self.metrics.expert_stats(s["name"], s["expert_pins"], s["expert_hit_rate"],
                                      s["expert_pins_host"])
