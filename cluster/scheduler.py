"""The central scheduler: continuous batching over a group of workers, in lockstep steps.

One iteration of `Scheduler.run`:
  1. admit waiting requests while any worker has a free slot (the worker with the largest
     free share of its capacity takes the next one, so slots fill in proportion);
  2. build one flat token batch per worker: one decode token for every sequence past its
     prompt, then prompt chunks of the sequences still prefilling (at most `prefill_chunk`
     prompt tokens per worker and step);
  3. step every worker at once (`group.step_all`) and wait for all of them;
  4. append the sampled tokens; a sequence that hit EOS, a stop string, its max_tokens or
     the context ends, and its slot is released by the end of this iteration: the worker
     frees it (saving its KV, unlocking its cache file) at the end of the step itself when
     the end is EOS or a length (`StepBatch.last` / `end_ids`: no extra call); the ends only
     the scheduler sees (stop strings) and failed sequences of a request with a saved-KV
     cache go in one release-only step, so that its file is unlocked before its Result goes
     out; those without a cache (nothing to unlock) are released with their worker's next
     batch, or at the job's end, at no extra call. Then the iteration's Results go out, and
     the slot is refilled in the very next step.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from cluster.metrics import JobMetrics, WorkerGauges
from cluster.requests import Request, Result, request_digest
from workers.actor import StepBatch, StepOutput, WorkerGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """A request with its prompt tokenized and the job defaults filled in."""
    req: Request
    prompt_ids: np.ndarray  # int32[P], 1 <= P <= max_context
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...] = ()
    cache: str | None = None  # saved-KV name: resume from it, save to it (workers/persist.py)


@dataclass
class _Seq:
    key: int
    item: Prepared
    worker: int
    t_admit: float
    prefilled: int = 0  # prompt tokens already in the worker's KV
    cached: int = 0  # of which loaded from the sequence's saved KV
    out: list[int] = field(default_factory=list)
    decode_sampled: int = 0  # of its sampled tokens, those sampled in decode-only steps
    t_first: float | None = None
    t_last: float | None = None

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.item.prompt_ids)


@dataclass
class SchedulerStats:
    steps: int = 0
    wall_s: float = 0.0  # whole iterations (admission, batches, step, results)
    forward_s: float = 0.0  # per step, the slowest worker's forward time
    # generated tokens (EOS included) of the sequences that delivered them: each token
    # once, not again when a dead worker's sequence re-samples it on a survivor
    tokens: int = 0
    decode_steps: int = 0  # steps with no prompt tokens in them
    decode_wall_s: float = 0.0
    decode_forward_s: float = 0.0
    decode_driver_s: float = 0.0  # the scheduler's own Python: admission, batches, results
    decode_tokens: int = 0  # of `tokens`, those sampled in decode steps
    # workers found dead (the soak's "kills"), each once: in a step, or by the group while
    # they were still loading (WorkerGroup.dead_at_start)
    worker_deaths: int = 0
    recoveries: int = 0  # deaths after which the job went on with live workers
    requeued: int = 0  # sequences re-run from their prompts after their worker died
    # tokens those sequences had sampled, lost with the dead worker's KV: the work redone
    # (where no worker is left, the requests fail instead). tokens + rerun_tokens is every
    # token sampled, what kvfleet_tokens_generated counts (cluster/metrics.py)
    rerun_tokens: int = 0
    kv_cache: dict[str, int] = field(default_factory=dict)  # saved-KV counts (workers/persist.py)
    kv_bytes_peak: int = 0  # most KV pool bytes held at once, summed over workers
    fallbacks: dict[str, int] = field(default_factory=dict)  # path -> count (workers/fallbacks.py)
    # Unix time (time.time()) when run() returned, its last step taken: a worker killed after
    # it had nothing left to run, so no death is found or recovered (the soak's kills after
    # the end, cluster/soak/runner.py)
    steps_done_at: float | None = None

    @property
    def overhead_per_decode_step_s(self) -> float:
        """Everything in a decode step that is not Model.forward: the scheduler's own work,
        the worker's slot mapping and sampling, and the Ray round trip where there is one."""
        return (self.decode_wall_s - self.decode_forward_s) / max(self.decode_steps, 1)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_wall_s if self.decode_wall_s else 0.0


class Scheduler:
    def __init__(self, group: WorkerGroup, *, max_context: int, prefill_chunk: int,
                 eos_ids: Iterable[int], decode: Callable[[list[int]], str], tier: str,
                 metrics: JobMetrics | None = None, clock: Callable[[], float] = time.perf_counter):
        self.group = group
        self.max_context, self.prefill_chunk = max_context, prefill_chunk
        self.eos = frozenset(int(e) for e in eos_ids)
        self._end_ids = tuple(sorted(self.eos))
        self.decode, self.tier = decode, tier
        self.metrics = metrics or JobMetrics(enabled=False)
        self.clock = clock
        self.stats = SchedulerStats()
        # driven here for every kind of group, as the other gauges are (no group needs
        # metrics of its own); looked up per call: with metrics off it is never called
        self.gauges = WorkerGauges(self.metrics, lambda: self.group.worker_stats(), clock=clock)
        self._next_key = 0
        # slots to free in this iteration's release-only step / with the worker's next batch
        # (_release_now decides), and of each the keys of failed sequences: KV not saved
        self._release: list[list[int]] = [[] for _ in group.names]
        self._discard: list[list[int]] = [[] for _ in group.names]
        self._later: list[list[int]] = [[] for _ in group.names]
        self._later_discard: list[list[int]] = [[] for _ in group.names]
        self._dead: set[int] = set()
        self._results: list[Result] = []  # this iteration's, handed out once released
        self._ttft_lines: set[int] = set()  # requests whose first token the histogram has
        # the ones that died while loading: the group has recovered from them already (no
        # slots; the sharded group moved their experts) and never steps them, so no step
        # finds them: counted here, as a step's deaths are, nothing to re-queue
        self._dead |= set(group.dead_at_start)
        for w in group.dead_at_start:
            self._count_death(w, requeued=0, lost_tokens=0)

    def run(self, items: Iterable[Prepared], on_result: Callable[[Result], None],
            should_stop: Callable[[], bool] = lambda: False) -> SchedulerStats:
        """Generate for every item; `on_result` gets each Result as its sequence ends.
        `should_stop()` true = admit nothing more and finish the sequences in flight.
        Meanwhile the metrics' gauges are kept alive (JobMetrics.keep_alive)."""
        with self.metrics.keep_alive():
            return self._run(items, on_result, should_stop)

    def _run(self, items, on_result, should_stop) -> SchedulerStats:
        waiting = deque(items)
        active: list[_Seq] = []
        while waiting or active:
            t_iter = self.clock()
            if should_stop():
                waiting.clear()
            self._admit(waiting, active)
            self.metrics.queue(len(waiting), len(active))
            if not active:
                if waiting:  # no live worker has a slot (e.g. the last died while starting)
                    self._fail_all(waiting)
                    self._emit(on_result)
                break
            batches, sampled, n_prompt = self._build(active)
            t0 = self.clock()
            outs = self.group.step_all(batches)
            failed = {w: e for w, e in outs.items() if isinstance(e, BaseException)}
            if failed:
                self._recover(failed, batches, waiting, active)
                outs = {w: o for w, o in outs.items() if w not in failed}
            t1 = self.clock()
            n_tok = self._apply(outs, sampled, active, decode=n_prompt == 0)
            self._flush_releases(waiting, active)
            self._emit(on_result)
            wall = self.clock() - t_iter
            self._account(outs, wall, wall - (t1 - t0), n_tok, n_prompt)
            self.gauges.tick()
        # the slots left for a next batch that will not come (their Results are out already)
        for w in range(len(self.group.names)):
            self._release[w] += self._later[w]
            self._discard[w] += self._later_discard[w]
        self._later = [[] for _ in self.group.names]
        self._later_discard = [[] for _ in self.group.names]
        self._flush_releases(waiting, [])
        self._emit(on_result)
        # the gauges say what is in flight now (nothing), not what the last step had
        self.metrics.queue(len(waiting), 0)
        self.metrics.step(0, 0.0)
        self.gauges.close()
        self.stats.steps_done_at = time.time()
        return self.stats

    # -- failures -----------------------------------------------------------------------
    def _recover(self, failed: dict[int, BaseException], batches: dict[int, StepBatch],
                 waiting: deque, active: list[_Seq]) -> None:
        """A dead worker's sequences go back to the front of the queue and are re-run from
        their prompts elsewhere (sampling is stateless per (seed, token index), so the
        re-run gives the same tokens); the tokens they had sampled move from stats.tokens to
        stats.rerun_tokens, as their re-run samples them again. A live worker whose step
        raised fails only the sequences of that step, and their slots are released."""
        dead = {w for w, exc in failed.items() if self.group.is_dead(w, exc)}
        self._dead |= dead  # all of this step's deaths before any counts as recovered
        live = self._live()
        for w, exc in failed.items():
            stepped = set(batches[w].keys.tolist()) if w in batches else set()
            mine = [s for s in active if s.worker == w and (w in dead or s.key in stepped)]
            for s in mine:
                active.remove(s)
            if w in dead:
                self._release[w], self._discard[w] = [], []
                self._later[w], self._later_discard[w] = [], []
                log.warning("worker %s died (%s); re-queueing its %d sequences: %s",
                            self.group.names[w], exc, len(mine), [s.item.req.id for s in mine])
                lost = sum(len(s.out) for s in mine)  # (a running sequence's out: all it sampled)
                st = self.stats
                st.tokens -= lost
                st.decode_tokens -= sum(s.decode_sampled for s in mine)
                st.rerun_tokens += lost
                # (re-run only where a worker is left: else they fail below, not re-run)
                self._count_death(w, requeued=len(mine) if live else 0, lost_tokens=lost)
                for s in reversed(mine):
                    waiting.appendleft(s.item)
            else:
                log.error("worker %s: step failed for %d sequences: %r", self.group.names[w],
                          len(mine), exc)
                for s in mine:  # (a failed request leaves its saved conversation whole)
                    self._results.append(self._result(s, "error", f"worker step failed: {exc!r}"))
                    self._free_slot(s, discard=True)
        if len(self._dead) == len(self.group.names):
            self._fail_all(waiting)

    def _live(self) -> bool:
        """Whether a worker not found dead has slots (the job can go on)."""
        return any(c > 0 for i, c in enumerate(self.group.capacities) if i not in self._dead)

    def _count_death(self, w: int, requeued: int, lost_tokens: int) -> None:
        """Worker w found dead (self._dead has it and this step's other deaths): the stats
        and metrics count it, and a recovery where a live worker with slots is left."""
        st = self.stats
        st.worker_deaths += 1
        st.recoveries += self._live()
        st.requeued += requeued
        self.metrics.worker_died(requeued, lost_tokens)
        self.metrics.forget(self.group.names[w])  # (its gauges age out, as it did)

    def _fail_all(self, waiting: deque) -> None:
        log.error("no live worker left; %d requests fail", len(waiting))
        while waiting:
            item = waiting.popleft()
            self._results.append(self._result(_Seq(-1, item, 0, self.clock()), "error",
                                              "no live worker left"))

    def _emit(self, on_result) -> None:
        results, self._results = self._results, []
        for r in results:
            on_result(r)

    # -- admission ----------------------------------------------------------------------
    def _admit(self, waiting: deque, active: list[_Seq]) -> None:
        used = np.zeros(len(self.group.capacities), np.int64)
        for s in active:
            used[s.worker] += 1
        free = np.asarray(self.group.capacities) - used
        free[list(self._dead)] = 0
        cap = np.maximum(np.asarray(self.group.capacities), 1)
        while waiting and free.max() > 0:
            # in proportion to capacity: the largest free share, then most free, lowest index
            w = int(np.lexsort((np.arange(len(free)), -free, -free / cap))[0])
            active.append(_Seq(self._next_key, waiting.popleft(), w, self.clock()))
            self._next_key += 1
            free[w] -= 1

    # -- one step's batches -------------------------------------------------------------
    def _build(self, active: list[_Seq]):
        rows: dict[int, list] = {}
        sampled: dict[int, list[_Seq]] = {}
        budget = {}
        attach: dict[int, dict] = {}
        n_prompt = 0
        for s in active:  # decode tokens first, so prefill never starves a decode
            if s.decoding:
                pos = len(s.item.prompt_ids) + len(s.out) - 1
                self._add(rows, sampled, s, [s.out[-1]], pos, sample=True)
        for s in active:
            if s.decoding:
                continue
            left = budget.setdefault(s.worker, self.prefill_chunk)
            if left == 0:
                continue
            n = min(left, len(s.item.prompt_ids) - s.prefilled)
            chunk = s.item.prompt_ids[s.prefilled:s.prefilled + n]
            done = s.prefilled + n == len(s.item.prompt_ids)
            if s.prefilled == 0 and s.item.cache is not None:  # the worker may load a prefix
                attach.setdefault(s.worker, {})[s.key] = (s.item.cache, s.item.prompt_ids)
            self._add(rows, sampled, s, chunk, s.prefilled, sample=done)
            s.prefilled += n
            budget[s.worker] = left - n
            n_prompt += n
        batches = {}
        for w, parts in rows.items():
            keys, toks, pos, at = [], [], [], []
            n = 0
            for key, t, p0, sample in parts:
                keys.append(np.full(len(t), key, np.int64))
                toks.append(np.asarray(t, np.int32))
                pos.append(np.arange(p0, p0 + len(t), dtype=np.int32))
                n += len(t)
                if sample:
                    at.append(n - 1)
            seqs = sampled[w]
            batches[w] = StepBatch(
                keys=np.concatenate(keys), tokens=np.concatenate(toks),
                positions=np.concatenate(pos), sample_at=np.asarray(at, np.int32),
                temperature=np.array([s.item.temperature for s in seqs], np.float32),
                top_p=np.array([s.item.top_p for s in seqs], np.float32),
                seed=np.array([s.item.seed for s in seqs], np.uint64),
                counter=np.array([len(s.out) for s in seqs], np.uint64),
                last=np.array([self._last(s) for s in seqs], bool), end_ids=self._end_ids,
                release=tuple(self._later[w]), discard=tuple(self._later_discard[w]),
                attach=attach.get(w, {}))
            self._later[w], self._later_discard[w] = [], []
        return batches, sampled, n_prompt

    @staticmethod
    def _add(rows, sampled, s: _Seq, tokens, pos0: int, sample: bool) -> None:
        rows.setdefault(s.worker, []).append((s.key, tokens, pos0, sample))
        sampled.setdefault(s.worker, [])
        if sample:
            sampled[s.worker].append(s)

    # -- results ------------------------------------------------------------------------
    def _apply(self, outs: dict[int, StepOutput], sampled, active: list[_Seq],
               decode: bool) -> int:
        now = self.clock()
        finished: list[_Seq] = []
        n_tok = 0
        by_key = {s.key: s for s in active}
        for out in outs.values():  # prefill resumes past what a worker loaded
            for key, n in out.loaded.items():
                s = by_key[key]
                s.cached, s.prefilled = n, max(s.prefilled, n)
        for w, out in outs.items():
            for s, tok in zip(sampled[w], out.next_tokens.tolist()):
                n_tok += 1
                s.decode_sampled += decode
                if s.t_first is None:
                    s.t_first = now
                    if s.item.req.line not in self._ttft_lines:  # once, not again when re-run
                        self._ttft_lines.add(s.item.req.line)
                        self.metrics.ttft(now - s.t_admit)
                if int(tok) not in self.eos:  # (the rate's last token: EOS is not in out)
                    s.t_last = now
                freed = int(tok) in self.eos or self._last(s)  # by the worker (StepBatch.last)
                reason = self._finish_reason(s, int(tok))
                if reason is not None:
                    self._results.append(self._result(s, reason))
                    finished.append(s)
                    if not freed:  # a stop string
                        self._free_slot(s)
        for s in finished:
            active.remove(s)
        return n_tok

    @staticmethod
    def _release_now(s: _Seq) -> bool:
        """Whether s's slot (ended where the worker cannot see it) is freed in this iteration's
        release-only step: where it has a saved-KV cache, whose file stays locked until then
        (a caller reusing it after the Result would find it busy). Others wait for their
        worker's next batch: an extra round trip to the workers per such iteration would
        slow stop-string workloads for nothing."""
        return s.item.cache is not None

    def _free_slot(self, s: _Seq, discard: bool = False) -> None:
        rel, dis = ((self._release, self._discard) if self._release_now(s)
                    else (self._later, self._later_discard))
        rel[s.worker].append(s.key)
        if discard:
            dis[s.worker].append(s.key)

    def _last(self, s: _Seq) -> bool:
        """The token s samples next ends it whatever it is (_finish_reason's length rules)."""
        n = len(s.out) + 1
        return n >= s.item.max_tokens or len(s.item.prompt_ids) + n >= self.max_context

    def _finish_reason(self, s: _Seq, tok: int) -> str | None:
        if tok in self.eos:
            return "stop"
        s.out.append(tok)
        if s.item.stop and _stop_at(self.decode(s.out), s.item.stop) is not None:
            return "stop"
        if len(s.out) >= s.item.max_tokens:
            return "length"
        if len(s.item.prompt_ids) + len(s.out) >= self.max_context:
            return "length"  # the next decode token would have no room in the slot
        return None

    def _result(self, s: _Seq, reason: str, error: str | None = None) -> Result:
        text = self.decode(s.out) if s.out else ""
        cut = _stop_at(text, s.item.stop) if s.item.stop else None
        if cut is not None:
            text = text[:cut]
        rate = None
        if len(s.out) > 1 and s.t_last > s.t_first:
            rate = (len(s.out) - 1) / (s.t_last - s.t_first)
        r = s.item.req
        return Result(id=r.id, line=r.line, prompt=r.prompt, completion=text,
                      completion_tokens=list(s.out), prompt_token_count=len(s.item.prompt_ids),
                      completion_token_count=len(s.out), finish_reason=reason, error=error,
                      tier=self.tier, worker=self.group.names[s.worker] if s.key >= 0 else "",
                      ttft_s=None if s.t_first is None else s.t_first - s.t_admit,
                      decode_tokens_per_s=rate, cached_prompt_tokens=s.cached,
                      request_digest=request_digest(r))

    def _account(self, outs: dict[int, StepOutput], wall: float, driver: float, n_tok: int,
                 n_prompt: int) -> None:
        fwd = max((o.forward_s for o in outs.values()), default=0.0)
        st = self.stats
        st.steps += 1
        st.wall_s += wall
        st.forward_s += fwd
        st.tokens += n_tok
        if n_prompt == 0:
            st.decode_steps += 1
            st.decode_wall_s += wall
            st.decode_forward_s += fwd
            st.decode_driver_s += driver
            st.decode_tokens += n_tok
        self.metrics.step(n_tok, wall, decode=n_prompt == 0)
        st.kv_bytes_peak = max(st.kv_bytes_peak, sum(o.kv_bytes for o in outs.values()))
        for w, o in outs.items():
            for k, n in o.cache_events.items():
                st.kv_cache[k] = st.kv_cache.get(k, 0) + n
                self.metrics.kv_cache(k, n)
            self.metrics.kv_bytes(self.tier, self.group.names[w], o.kv_bytes)
            for path, n in o.fallbacks.items():
                if path not in st.fallbacks:  # (once per path: a fallback is never silent)
                    log.warning("worker %s: native path %s fell back to a slower one (counted "
                                "in kvfleet_fallbacks and the stats' fallbacks)",
                                self.group.names[w], path)
                st.fallbacks[path] = st.fallbacks.get(path, 0) + n
                self.metrics.fallback(path, n)

    def _flush_releases(self, waiting: deque, active: list[_Seq]) -> None:
        """One release-only step for the slots still to free (stop strings, failed
        sequences); none in the common case. A worker found dead there is recovered as in a
        step: its other sequences are re-queued."""
        empty = np.zeros(0, np.int32)
        batches = {w: StepBatch(keys=np.zeros(0, np.int64), tokens=empty, positions=empty,
                                sample_at=empty, temperature=np.zeros(0, np.float32),
                                top_p=np.zeros(0, np.float32), seed=np.zeros(0, np.uint64),
                                counter=np.zeros(0, np.uint64), release=tuple(keys),
                                discard=tuple(self._discard[w]))
                   for w, keys in enumerate(self._release) if keys and w not in self._dead}
        self._release = [[] for _ in self.group.names]
        self._discard = [[] for _ in self.group.names]
        if batches:
            dead = {}
            for w, o in self.group.step_all(batches).items():
                if isinstance(o, BaseException):
                    log.warning("worker %s: releasing slots failed: %r", self.group.names[w], o)
                    if self.group.is_dead(w, o):  # (the released ones' last saves are lost)
                        dead[w] = o
                    continue
                for k, n in o.cache_events.items():  # the last sequences' KV saves
                    self.stats.kv_cache[k] = self.stats.kv_cache.get(k, 0) + n
                    self.metrics.kv_cache(k, n)
                self.metrics.kv_bytes(self.tier, self.group.names[w], o.kv_bytes)
            if dead:
                self._recover(dead, {}, waiting, active)


def _stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    """Index of the earliest stop string in text, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
