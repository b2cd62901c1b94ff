"""The expert-parallel worker group: one ShardedWorker actor per fleet device, each with the
dense weights, its share of the KV slots and a shard of the routed experts; lockstep steps;
recovery when a worker dies.

Placement and the expert split: cluster/placement.py.

A step (`step_all`) submits every worker's batch at once. When some fail, the group pings
every live worker (`alive`, served in the experts concurrency group even mid-step) to see
who is gone; a step still running `watch_s` after it began is pinged too (and again every
`watch_s`), so a hung worker that no peer's failed step points at is found all the same. For each dead worker: its experts go to the survivors with the most room left,
pinned while they fit a survivor's room, else served from its host memory (`_move_experts`;
`reassign`: they read just those tensors from the checkpoint), its capacity drops to 0, and
its step (if it had one) is reported as dead, so the scheduler re-queues its sequences
(their KV died with it: they re-prefill from the prompt). A survivor whose step failed part
way (a peer vanished under it) reruns the very same batch: it rewrites the same KV
positions (KVPool.write overwrites rows and keeps the longest length), its slots are
already mapped, sampling is stateless per (seed, token index), so the rerun gives the same
tokens. Failures where nobody died go back to the scheduler as they are.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np

from cluster.config import JobConfig
from cluster.metrics import JobMetrics
from cluster.placement import Placement, fleet_placements, split_owners
from cluster.ray_options import PLAIN_FIELDS
from workers.actor import LocalGroup, StepBatch, StepOutput
from workers.collect import StepHung, collect_steps
from workers.ep_worker import EXPERT_CALL_THREADS, EXPERT_GROUP

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """The step result of a worker found dead (the scheduler re-queues its sequences)."""


class ShardedGroup:
    """WorkerGroup (workers/actor.py) of ShardedWorker actors; see the module docstring."""
    grace_s = 30.0  # a step still running this long after a peer's step failed is pinged
    # and one still running this long after it began, and again as often while it runs: a
    # hung worker whose peers' steps do not fail (none routed a token to it: they had no
    # step, or only their own experts' tokens) held the group for ever
    watch_s = 60.0
    ping_timeout_s = 30.0  # a worker that does not answer a ping within this is gone

    def __init__(self, cfg: JobConfig, placements: list[Placement], sharded: bool = True,
                 metrics: JobMetrics | None = None, start_timeout_s: float = 600.0):
        import ray
        from cluster.ray_options import check_placeable
        from workers.ep_worker import ShardedWorker
        w = cfg.workers  # (an actor no node can host would keep the job waiting: fail first)
        check_placeable(ray, [(p.spec.name, p.options) for p in placements],
                        f"workers.fleet {w.fleet}" if w.fleet is not None else PLAIN_FIELDS)
        self.sharded = sharded
        self.metrics = metrics or JobMetrics()  # Ray metrics (Ray is up by now)
        self.names = [p.spec.name for p in placements]
        self.capacities = [p.spec.slots for p in placements]
        self.kinds = [p.kind for p in placements]
        self.room = [p.expert_room for p in placements]
        split = split_owners(cfg, self.room, self.kinds, sharded)
        self.owners, self.pinned, self.expert_bytes = split.owners, split.pinned, split.expert_bytes
        self.dead: set[int] = set()
        self.deaths = self.recoveries = self.experts_moved = 0
        self.final_stats: list[dict] = []  # worker_stats() as close() found them
        tag = uuid.uuid4().hex[:6]
        cls = ray.remote(concurrency_groups={EXPERT_GROUP: EXPERT_CALL_THREADS})(ShardedWorker)
        self.actors = [cls.options(name=f"kvfleet-{tag}-{p.spec.name.replace('/', '.')}",
                                   **p.options).remote(p.spec, p.kind, r, self.owners[r], self.pinned[r])
                       for r, p in enumerate(placements)]
        refs = [a.info.remote() for a in self.actors]
        self.info: list[dict | None] = []
        deadline = time.monotonic() + start_timeout_s
        for name, ref in zip(self.names, refs):  # waits for the model loads
            try:
                self.info.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
            except ray.exceptions.GetTimeoutError:  # an actor no node can host never starts
                self.close()
                raise RuntimeError(f"worker actors did not start within {start_timeout_s:.0f}s; does "
                                   f"a node offer what they ask for? {[p.options for p in placements]}") from None
            except ray.exceptions.RayActorError as e:  # died while loading: recovered below
                log.warning("worker %s died while starting: %s", name, _why(e))
                self.info.append(None)
        started = [i for i, info in enumerate(self.info) if info is not None]
        if not started:
            raise RuntimeError(f"all {len(self.actors)} worker actors died while starting")
        if sharded:
            peers = dict(enumerate(self.actors))
            ray.get([self.actors[i].connect.remote(peers) for i in started])
        for i in self.info:
            if i is not None:
                log.info("worker %s: %s on %s pid %s, %d slots, %d routed experts", i["name"],
                         i["device"], i["host"], i["pid"], i["slots"], i["experts"])
        # before the first step: the survivors take the experts, the slots are gone; the
        # scheduler counts these deaths (no step of its finds them)
        self.dead_at_start = [i for i, info in enumerate(self.info) if info is None]
        if self.dead_at_start:
            self._recover(self.dead_at_start)

    # -- steps ----------------------------------------------------------------------------
    def step_all(self, batches: dict[int, StepBatch]) -> dict[int, StepOutput | Exception]:
        out: dict[int, StepOutput | Exception] = {}
        pending = {i: b for i, b in batches.items() if i not in self.dead}
        for i in set(batches) - set(pending):
            out[i] = WorkerDied(f"worker {self.names[i]} is dead")
        while pending:  # each further round follows a new death, so this ends
            results = self._run(pending)
            failed = {i: r for i, r in results.items() if isinstance(r, BaseException)}
            out.update({i: r for i, r in results.items() if i not in failed})
            if not failed:
                break
            dead = self._find_dead(hung=[i for i, r in failed.items() if isinstance(r, StepHung)])
            if not dead:
                out.update(failed)  # real step errors: the scheduler fails those sequences
                break
            self._recover(dead)
            for i in dead:
                out[i] = WorkerDied(_why(failed.get(i)))
            pending = {i: batches[i] for i in failed if i not in self.dead}
            if pending:
                log.warning("re-running the step on %s (their step failed part way)",
                            [self.names[i] for i in pending])
        return out

    def _run(self, batches: dict[int, StepBatch]) -> dict[int, Any]:
        """Each worker's step result or error. Once a step has failed, the ones still running
        get grace_s more; then they are pinged, as are steps still running watch_s after they
        began (and every watch_s after that): one that does not answer (hung: its peers'
        expert calls timed out, or nobody called it) gets a StepHung, so _find_dead kills it
        instead of it holding the group forever; one that answers is only slow, and is waited
        for."""
        import ray
        refs = {i: self.actors[i].step.remote(b) for i, b in batches.items()}
        return collect_steps(ray, refs, {i: self.names[i] for i in refs}, self.grace_s,
                             self._silent, timeout_s=self.watch_s, every_s=self.watch_s)

    def is_dead(self, worker: int, exc: BaseException) -> bool:
        return worker in self.dead


    # -- failures -------------------------------------------------------------------------
    def _silent(self, workers) -> dict[int, str]:
        """Ping `workers` in their experts group (answers even mid-step), all at once: those
        that do not answer within ping_timeout_s, with why."""
        import ray
        refs = {i: self.actors[i].alive.options(concurrency_group=EXPERT_GROUP).remote()
                for i in workers}
        silent = {}
        deadline = time.monotonic() + self.ping_timeout_s
        for i, ref in refs.items():
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                silent[i] = type(e).__name__
        return silent

    def _find_dead(self, hung=()) -> list[int]:
        """Ping every live worker; kill and return those that do not answer, and the `hung`
        ones: their step outlived the grace and they did not answer the ping collect_steps
        just sent (a second ping would wait out ping_timeout_s again, for the same answer)."""
        import ray
        silent = {i: "its step hung and it did not answer a ping" for i in hung}
        silent.update(self._silent([i for i in range(len(self.actors))
                                    if i not in self.dead and i not in silent]))
        for i, why in silent.items():
            log.error("worker %s is gone: %s", self.names[i], why)
            ray.kill(self.actors[i], no_restart=True)  # a hung one must not come back
        return list(silent)

    def _recover(self, dead: list[int]) -> None:
        import ray
        self.dead.update(dead)
        self.deaths += len(dead)
        for i in dead:
            self.capacities[i] = 0
        live = [i for i in range(len(self.actors)) if i not in self.dead]
        names = [self.names[i] for i in dead]
        if not live:
            log.error("workers %s died and none is left", names)
            return
        moved = self._move_experts(dead, live) if self.sharded else {}
        try:
            ray.get([self.actors[i].reassign.remote(self.owners[i], tuple(dead), self.pinned[i])
                     for i in live])
        except ray.exceptions.RayError as e:  # another one died meanwhile: next round finds it
            log.error("reassigning experts failed: %s", e)
        n = sum(len(v) for v in moved.values())
        self.experts_moved += n
        self.recoveries += 1
        self.metrics.experts_moved(n)
        log.warning("workers %s died; %d of their routed experts moved to %s", names, n,
                    {self.names[w]: len(v) for w, v in moved.items()})

    def _move_experts(self, dead: list[int], live: list[int]) -> dict[int, list]:
        """Orphaned experts to the survivors with the most expert room left, pinned where
        they still fit it. The group does this accounting, not the worker: it holds the
        plan's rooms and the pinned table, and hands the worker the table to follow (as at
        the start), so the plan stays the one record of what each device holds. A room is
        what the plan gave the worker for experts (Placement.expert_room); a cuda worker's
        is device memory, used by the experts it pins (the others are in host memory), a cpu
        or metal worker's is the memory that holds all it owns."""
        from cluster.planner import assign_experts, deal_evenly
        owners = self.owners[0]
        orphans = np.array([(l, e) for l, o in owners.items() for e in np.flatnonzero(np.isin(o, dead))],
                           np.int32).reshape(-1, 2)
        if not len(orphans):
            return {}
        used = {i: sum(int((self.pinned[i][l] if self.kinds[i] == "cuda" else o == i).sum())
                       for l, o in owners.items()) for i in live}
        eb = [self.expert_bytes[i] for i in live]
        rooms = [self.room[i] - used[i] * b for i, b in zip(live, eb)]
        a = deal_evenly(rooms, eb, orphans)  # (orphans come layer by layer)
        if a is None:
            a = assign_experts(rooms, eb, orphans)
        new = {l: o.copy() for l, o in owners.items()}
        pinned = [{l: p.copy() for l, p in t.items()} for t in self.pinned]
        moved: dict[int, list] = {}
        for (l, e), k, pin in zip(orphans.tolist(), a.owner.tolist(), a.pinned.tolist()):
            new[l][e] = live[k]
            pinned[live[k]][l][e] = pin
            moved.setdefault(live[k], []).append((l, e))
        self.owners, self.pinned = [new] * len(self.actors), pinned
        return moved

    # -- stats ----------------------------------------------------------------------------
    def worker_stats(self) -> list[dict]:
        """ShardedWorker.stats() of every live worker (the scheduler's expert gauges read
        them: cluster/metrics.py WorkerGauges). One that died since its last step is left
        out with a warning (workers/actor.gather_stats); the death shows up at the next step."""
        from workers.actor import gather_stats
        return gather_stats(self.actors, self.names, self.dead)

    def close(self) -> None:
        import ray
        self.final_stats = self.worker_stats()  # (the live workers': one gone is left out)
        for s in self.final_stats:
            log.info("worker %s (%s): %d experts held, %d on the GPU and %d in host memory, "
                     "hit rate %s, %d picks served for peers, %d picks computed on the host, "
                     "rss %.0f MB", s["name"], s["device"], s["expert_pins"],
                     s["expert_pins_device"], s["expert_pins_host"],
                     "-" if s["expert_hit_rate"] is None else f"{s['expert_hit_rate']:.3f}",
                     s["served_picks"], s["host_picks"], s["rss_bytes"] / 1e6)
        for a in self.actors:
            ray.kill(a)


def start_group(cfg: JobConfig):
    """(group, close) for the generate job: ShardedGroup on Ray, or ShardedWorkers in this
    process over LocalTransport (`workers.runtime: inprocess`; nothing can die there)."""
    placements = fleet_placements(cfg)
    sharded = cfg.workers.experts == "sharded"
    if cfg.workers.runtime == "inprocess":
        return local_group(cfg, placements, sharded), lambda: None
    import ray
    from cluster.jobs.generate import connect_ray
    started = connect_ray(cfg, [(p.spec, p.options) for p in placements])
    group = ShardedGroup(cfg, placements, sharded)

    def close() -> None:
        group.close()
        if started:
            ray.shutdown()
    return group, close


def local_group(cfg: JobConfig, placements: list[Placement], sharded: bool = True):
    from workers.ep_worker import ShardedWorker
    split = split_owners(cfg, [p.expert_room for p in placements], [p.kind for p in placements],
                         sharded)
    workers = [ShardedWorker(p.spec, p.kind, r, split.owners[r], split.pinned[r])
               for r, p in enumerate(placements)]
    for w in workers:
        w.connect(dict(enumerate(workers)), transport="local")
    return LocalGroup(workers)  # ShardedWorkers in this process over LocalTransport


def _why(exc: BaseException | None) -> str:
    """One line for the log: Ray's death messages run over many lines; the last says why."""
    if exc is None:
        return "found dead by a ping"
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"

