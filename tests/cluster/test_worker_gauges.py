"""The expert gauges of in-process replicated workers (LocalGroup, the default
`workers.experts: replicated`): the scheduler sets them from the workers' stats at most
every interval and once more at the end of its run; a stats call that fails warns and the
job goes on. (They were set only by the sharded group: a replicated job never had them.)"""
from __future__ import annotations

import logging

import numpy as np

from cluster.metrics import JobMetrics
from cluster.scheduler import Scheduler
from runtime_helpers import prepared
from workers.actor import LocalGroup, Worker, WorkerSpec
from workers.tokenizer import Tokenizer


class Ticks:
    """A clock that moves a quarter second per reading (the scheduler reads it a few times an
    iteration): the run spans several gauge intervals, each of several iterations."""
    t = 0.0

    def __call__(self) -> float:
        self.t += 0.25
        return self.t


def items(n=6):
    rng = np.random.default_rng(4)
    return [prepared(i, rng.integers(5, 500, size=int(rng.integers(2, 20))), max_tokens=10)
            for i in range(n)]


def run(group, tiny, metrics, clock=None):
    tok = Tokenizer.from_dir(tiny)
    results = []
    Scheduler(group, max_context=64, prefill_chunk=16, eos_ids=tok.eos_ids, decode=tok.decode,
              tier="f32", metrics=metrics, clock=clock or Ticks()).run(items(), results.append)
    return results


def group_of(tiny, *names):
    return LocalGroup([Worker(WorkerSpec(n, str(tiny), "f32", 2, 64)) for n in names])


def test_set_at_most_every_interval_and_once_more_at_the_end(tiny):
    group, clock, m = group_of(tiny, "a", "b"), Ticks(), JobMetrics(use_ray=False)
    steps, seen = [0], []  # seen: (clock reading, steps run) at each stats call
    real_step, real_stats = group.step_all, group.worker_stats

    def step_all(batches):
        steps[0] += 1
        return real_step(batches)

    def worker_stats():
        seen.append((clock.t, steps[0]))
        return real_stats()
    group.step_all, group.worker_stats = step_all, worker_stats
    results = run(group, tiny, m, clock)
    assert len(results) == 6 and not any(r.error for r in results)
    times = [t for t, _ in seen]
    assert seen[0][1] == 1  # right after the first step
    assert all(b - a >= 5.0 for a, b in zip(times, times[1:-1]))  # the ticks: 5 s apart at least
    assert seen[-1][1] == steps[0]  # and once more after the last step
    assert 3 <= len(seen) < steps[0]
    for name in ("a", "b"):  # 2 MoE layers x 8 routed experts, all held, in host memory
        assert m.local[f"expert_pins[{name}]"] == 16
        assert m.local[f"expert_pins_host[{name}]"] == 16
        assert m.local[f"expert_hit_rate[{name}]"] == 1.0
    # generate's Summary.workers (getattr(group, "final_stats")): the same figures per worker
    assert [(s["name"], s["expert_pins"], s["expert_pins_host"]) for s in group.final_stats] \
        == [("a", 16, 16), ("b", 16, 16)]


def test_a_failing_stats_call_warns_and_the_job_goes_on(tiny, caplog):
    group, m = group_of(tiny, "a", "b"), JobMetrics(use_ray=False)
    calls = []
    real = group.workers[1].stats

    def stats():  # its second call fails: the gauges keep what the first set
        calls.append(1)
        if len(calls) == 2:
            raise OSError("/proc/self/status: No such file or directory")
        return real()
    group.workers[1].stats = stats
    caplog.set_level(logging.WARNING)
    results = run(group, tiny, m)
    ref = run(group_of(tiny, "a", "b"), tiny, JobMetrics(enabled=False))
    assert len(calls) >= 3  # it failed mid-run, and the calls went on after it
    assert [r.completion_tokens for r in results] == [r.completion_tokens for r in ref]
    assert not any(r.error for r in results)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("worker stats unavailable" in w and "/proc/self/status" in w for w in warned)
    assert m.local["expert_pins[b]"] == 16 and m.local["expert_hit_rate[b]"] == 1.0


def test_no_stats_call_with_metrics_off(tiny):
    group, calls = group_of(tiny, "a"), []
    group.worker_stats = lambda: calls.append(1) or []
    assert len(run(group, tiny, JobMetrics(enabled=False))) == 6
    assert calls == []  # (a stats round trip per interval for nothing, on Ray)
