"""ShardedGroup's step collection (workers/collect.py) on a small local Ray: once a worker's
step failed, a step still running after the grace is pinged; one that does not answer
counts as failed (it held the group forever), one that answers is slow and is waited for
(it was failed too)."""
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
