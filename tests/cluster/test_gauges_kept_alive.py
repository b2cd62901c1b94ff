"""The job's gauges are set again while a run lasts (cluster/metrics.py, JobMetrics.keep_alive):
Ray's metrics agent drops a gauge series ~20 s after its last set, and most are set only on
events (a step, a decode-only step, a stats pull), so a long step or a run of prefill steps
emptied the queue, slots, decode-rate, KV and expert panels. A fake metrics backend records
every set with the (fake) clock's time."""
from __future__ import annotations

import threading

from cluster.metrics import JobMetrics
from cluster.scheduler import Scheduler
from scheduler_fakes import EOS, decode
from test_scheduler import MAX_CTX, FailingGroup, make_group, prep, prompts


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


class Backend:
    """ray.util.metrics' Counter / Gauge / Histogram, recording gauge sets as
    (metric, tags, value, clock time, thread name)."""

    def __init__(self, clock):
        self.sets, self.clock = [], clock
        backend = self

        class Metric:
            def __init__(self, name, description="", boundaries=None, tag_keys=()):
                self.name = name

            def set(self, value, tags=None):
                backend.sets.append((self.name, tuple(sorted((tags or {}).items())), value,
                                     backend.clock(), threading.current_thread().name))
                if backend.on_set:
                    backend.on_set()

            def inc(self, value=1, tags=None):
                pass

            def observe(self, value, tags=None):
                pass
        self.Counter = self.Gauge = self.Histogram = Metric
        self.on_set = None

    def since(self, t):
        return [(n, tags, v) for n, tags, v, at, _ in self.sets if at >= t]


def test_a_gauge_not_set_for_refresh_s_is_set_again_to_its_last_value():
    clock = Clock()
    b = Backend(clock)
    m = JobMetrics(backend=b, clock=clock)  # refresh_s 5
    t0 = clock.t
    m.queue(3, 2)
    m.step(7, 0.5)  # decode rate 14
    m.kv_bytes("kv8", "w0", 123_456_789)
    m.expert_stats("w0", 16, 0.75, 4)
    assert len(b.sets) == 7
    clock.t = t0 + 4.9
    assert m.refresh() == 0 and len(b.sets) == 7  # (nothing is due yet)
    m.queue(5, 1)
    m.step(40, 9.0, decode=False)  # a prefill step leaves the decode rate as it was
    clock.t = t0 + 5.0
    assert m.refresh() == 5
    assert sorted(b.since(clock.t)) == sorted([
        ("kvfleet_decode_tokens_per_s", (), 14.0),
        ("kvfleet_kv_bytes_in_use", (("device", "w0"), ("tier", "kv8")), 123_456_789),
        ("kvfleet_expert_pins", (("device", "w0"),), 16),
        ("kvfleet_expert_pins_host", (("device", "w0"),), 4),
        ("kvfleet_expert_hit_rate", (("device", "w0"),), 0.75)])  # not the queue: set at 4.9
    clock.t = t0 + 9.9
    assert sorted(b.since(clock.t)) == [] and m.refresh() == 2
    assert sorted(b.since(clock.t)) == [("kvfleet_active_slots", (), 1),
                                        ("kvfleet_queue_depth", (), 5)]
    # a worker found dead: its series are left to age out, the job's own stay
    m.kv_bytes("kv8", "w1", 99)
    m.forget("w0")
    clock.t = t0 + 60
    assert m.refresh() == 4
    assert sorted(b.since(clock.t)) == [("kvfleet_active_slots", (), 1),
                                        ("kvfleet_decode_tokens_per_s", (), 14.0),
                                        ("kvfleet_kv_bytes_in_use", (("device", "w1"), ("tier", "kv8")), 99),
                                        ("kvfleet_queue_depth", (), 5)]


def test_without_ray_nothing_is_kept_and_no_thread_runs():
    m = JobMetrics(use_ray=False)
    before = {t.name for t in threading.enumerate()}
    with m.keep_alive():
        m.queue(3, 2)
        assert "kvfleet-gauges" not in {t.name for t in threading.enumerate()} - before
    assert m.refresh() == 0 and m.local["queue_depth"] == 3


def test_a_long_step_has_its_gauges_set_again_and_the_thread_ends_with_the_run():
    """A step that lasts past several intervals: the keep-alive thread sets the queue and
    slot gauges again during it (the step waits for both, up to 30 s); after run() returns
    the thread is gone. (The step used to wait for any gauge set again: under load the first
    refresh of the step could come before the queue and slots, set just before it, were due,
    and the rest of the run set them itself, so they were never refreshed.)"""
    b = Backend(lambda: 0.0)
    m = JobMetrics(backend=b, refresh_s=0.05)
    group = make_group([2, 2])
    real, steps = group.step_all, [0]
    want = {"kvfleet_queue_depth", "kvfleet_active_slots"}
    kept, seen = threading.Event(), set()

    def on_set():
        if threading.current_thread().name == "kvfleet-gauges" and steps[0] == 5:
            seen.add(b.sets[-1][0])
            if want <= seen:
                kept.set()
    b.on_set = on_set

    def step_all(batches):
        steps[0] += 1
        if steps[0] == 5:  # (the queue, slots and the first steps' gauges are set by now)
            assert kept.wait(30), f"only {sorted(seen)} were set again during a long step"
        return real(batches)
    group.step_all = step_all
    results = []
    Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
              tier="f32", metrics=m).run([prep(i, p) for i, p in enumerate(prompts(6))],
                                         results.append)
    assert len(results) == 6 and not any(r.error for r in results)
    by_thread = {name for *_, name in b.sets}
    assert by_thread == {threading.current_thread().name, "kvfleet-gauges"}
    kept_names = {n for n, *_, name in b.sets if name == "kvfleet-gauges"}
    assert want <= kept_names
    assert "kvfleet-gauges" not in {t.name for t in threading.enumerate()}


def test_a_dead_workers_gauges_are_not_kept_alive():
    clock = Clock()
    b = Backend(clock)
    m = JobMetrics(backend=b, clock=clock)
    items = [prep(i, p, seed=i) for i, p in enumerate(prompts())]
    group = FailingGroup(make_group([3, 3]).workers, victim=1, at=6, dies=True)
    results = []
    Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
              tier="f32", metrics=m).run(items, results.append)
    assert len(results) == 16 and not any(r.error for r in results)
    devices = {dict(tags).get("device") for n, tags, *_ in b.sets if n == "kvfleet_kv_bytes_in_use"}
    assert devices == {"w0", "w1"}  # (both had theirs set before w1 died)
    clock.t += 60
    m.refresh()
    again = {dict(tags).get("device") for n, tags, _ in b.since(clock.t) if n == "kvfleet_kv_bytes_in_use"}
    assert again == {"w0"}
