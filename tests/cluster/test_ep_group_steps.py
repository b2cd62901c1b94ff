"""ShardedGroup's step collection (workers/collect.py) on a small local Ray: once a worker's
step failed, a step still running after the grace is pinged; one that does not answer
counts as failed (it held the group forever), one that answers is slow and is waited for
(it was failed too)."""
import os
import signal
import time

import pytest

from workers.collect import collect_steps


@pytest.fixture(scope="module")
def ray():
    import ray
    ray.init(address="local", num_cpus=3, include_dashboard=False)  # (never a running cluster)
    yield ray
    ray.shutdown()


def test_after_a_failure_a_silent_step_fails_and_a_slow_one_is_waited_for(ray):
    @ray.remote
    class Step:
        def run(self, what):
            if what == "fail":
                raise RuntimeError("peer timed out")
            if what == "hang":
                time.sleep(600)
            if what == "slow":
                time.sleep(3)
            return what

    a, b, c, d = Step.remote(), Step.remote(), Step.remote(), Step.remote()
    pinged = []

    def silent(workers):  # the ping: w2 hangs (no answer), w3 is busy but answers
        pinged.append(sorted(workers))
        return {i: "GetTimeoutError" for i in workers if i == 2}

    t0 = time.monotonic()
    out = collect_steps(ray, {0: a.run.remote("ok"), 1: b.run.remote("fail"),
                              2: c.run.remote("hang"), 3: d.run.remote("slow")},
                        {i: f"w{i}" for i in range(4)}, grace_s=1.0, silent=silent)
    assert time.monotonic() - t0 < 30
    assert out[0] == "ok" and "peer timed out" in str(out[1]) and out[3] == "slow"
    assert isinstance(out[2], TimeoutError) and "w2" in str(out[2])
    assert pinged == [[2, 3]]
    ray.kill(c)
    out = collect_steps(ray, {0: a.run.remote("x"), 1: b.run.remote("y")}, {0: "w0", 1: "w1"},
                        grace_s=0.0)  # without a failure every step is waited for
    assert out == {0: "x", 1: "y"}


def test_no_grace_waits_for_every_step_after_a_failure(ray):
    """RayGroup passes grace_s=inf (its rule is the step timeout alone) and step_timeout_s
    may be None: a failed step beside a running one then waits for that one. (The deadline
    became now + inf, and ray.wait's int(timeout * 1000) raised OverflowError, so the whole
    job failed on the first step error.)"""
    import math

    @ray.remote
    def step(what):
        if what == "fail":
            raise RuntimeError("bad batch")
        time.sleep(2)
        return what

    out = collect_steps(ray, {0: step.remote("fail"), 1: step.remote("slow")},
                        {0: "w0", 1: "w1"}, grace_s=math.inf, timeout_s=None)
    assert "bad batch" in str(out[0]) and out[1] == "slow"


def _stood_group(ray, n):
    """(actors, group, pinged): n _Stand actors in a ShardedGroup that records its pings.
    (The class is made here, so that Ray pickles it by value: the worker processes cannot
    import this test module.)"""
    from workers.ep_worker import EXPERT_CALL_THREADS, EXPERT_GROUP

    class _Stand:
        """A stand-in ShardedWorker: its step fails once on "fail-once" and sleeps on "hang" or
        "slow"; `alive` answers the group's pings (in the experts group, as a worker's does)."""

        def __init__(self):
            self.failures = 0

        def pid(self):
            return os.getpid()

        def step(self, what):
            if what == "fail-once" and not self.failures:
                self.failures += 1
                raise RuntimeError("expert peer 2 did not answer")
            time.sleep({"hang": 600, "slow": 6}.get(what, 0))
            return what

        def alive(self):
            return 1

        def reassign(self, owners, drop_peers=(), pinned=None):
            return {}

    cls = ray.remote(concurrency_groups={EXPERT_GROUP: EXPERT_CALL_THREADS})(_Stand)
    actors = [cls.remote() for _ in range(n)]
    g = _group_of(ray, actors, [f"w{i}" for i in range(n)])
    pinged, silent = [], g._silent
    g._silent = lambda workers, *a: (pinged.append(sorted(workers)), silent(workers, *a))[1]
    return actors, g, pinged


def _stop(ray, actor) -> int:
    """SIGSTOP the actor's process once it is up and serving (it hangs); its pid."""
    pid = ray.get(actor.pid.remote())
    ray.get(actor.step.remote("warm"))
    os.kill(pid, signal.SIGSTOP)
    return pid


def _group_of(ray, actors, names):
    """A ShardedGroup over stand-in actors (no model: replicated experts, metrics off)."""
    from cluster.ep_group import ShardedGroup
    from cluster.metrics import JobMetrics
    g = ShardedGroup.__new__(ShardedGroup)
    g.sharded, g.metrics, g.actors, g.names = False, JobMetrics(enabled=False), actors, names
    g.capacities, g.owners, g.dead = [1] * len(actors), [{}] * len(actors), set()
    g.pinned = [{}] * len(actors)
    g.deaths = g.recoveries = g.experts_moved = 0
    g.final_stats = []
    return g


def test_a_hung_worker_is_pinged_once_not_twice(ray):
    """Worker 2 hangs (its process stopped) while worker 1's step fails (a peer timed out).
    collect_steps pinged 2 after the grace (no answer: StepHung), then _find_dead pinged it
    again with every live worker and waited its ping timeout a second time: recovery took
    grace + 2 x ping timeout. Now it is pinged once (the others still are, for deaths the
    step did not show) and recovery takes grace + one ping timeout."""
    from cluster.ep_group import WorkerDied

    actors, g, pinged = _stood_group(ray, 3)
    g.grace_s, g.ping_timeout_s = 1.0, 3.0
    pid = _stop(ray, actors[2])
    try:
        t0 = time.monotonic()
        out = g.step_all({0: "ok", 1: "fail-once", 2: "hang"})
        took = time.monotonic() - t0
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert out[0] == "ok" and out[1] == "fail-once"  # w1 re-ran its step after the recovery
    assert isinstance(out[2], WorkerDied) and g.dead == {2} and g.deaths == 1
    assert pinged == [[2], [0, 1]]  # was [[2], [0, 1, 2]]
    # grace 1 s + one ping timeout 3 s (+ Ray's calls); twice the ping timeout took >= 7 s
    assert 4.0 <= took < 6.5, took


def test_a_hung_worker_no_peer_calls_is_found_by_a_ping(ray):
    """The only worker with a step hangs (its process stopped): no peer's step fails, so
    no grace ever started and the group waited for it for ever (a one-prompt job on a fleet,
    or a job's last sequences on one worker). Its step is pinged watch_s after it began: no
    answer, so it is dead. A slow step beside it answers every ping and is waited for."""
    import threading

    from cluster.ep_group import WorkerDied

    actors, g, pinged = _stood_group(ray, 3)
    g.watch_s, g.ping_timeout_s = 1.0, 2.0
    pid = _stop(ray, actors[1])
    box = {}
    t0 = time.monotonic()
    job = threading.Thread(target=lambda: box.update(out=g.step_all({1: "hang", 2: "slow"})), daemon=True)
    job.start()
    job.join(40)
    took = time.monotonic() - t0
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    if job.is_alive():  # (the old code: let the stand-in go, so the thread ends)
        ray.kill(actors[1])
    assert not job.is_alive(), "the group still waits for the hung worker's step"
    out = box["out"]
    assert isinstance(out[1], WorkerDied) and "does not answer a ping" in str(out[1])
    assert out[2] == "slow" and g.dead == {1} and g.deaths == 1
    assert pinged[0] == [1, 2] and [1] not in pinged[1:]  # the slow one pinged again meanwhile
    assert pinged.count([0, 2]) == 1 and pinged.count([2]) >= 1, pinged
    assert took < 20, took
