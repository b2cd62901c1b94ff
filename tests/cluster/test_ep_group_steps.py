"""ShardedGroup's step collection on a small local Ray: a step that hangs after another
worker's step failed counts as failed after the grace period (it held the group forever),
so the group pings the workers and kills the hung one."""
import time

import pytest

from cluster.ep_group import collect_steps


@pytest.fixture(scope="module")
def ray():
    import ray
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def test_a_hung_step_fails_after_the_grace_once_another_failed(ray):
    @ray.remote
    class Step:
        def run(self, what):
            if what == "fail":
                raise RuntimeError("peer timed out")
            if what == "hang":
                time.sleep(600)
            return what

    a, b, c = Step.remote(), Step.remote(), Step.remote()
    t0 = time.monotonic()
    out = collect_steps(ray, {0: a.run.remote("ok"), 1: b.run.remote("fail"),
                              2: c.run.remote("hang")}, {0: "w0", 1: "w1", 2: "w2"}, grace_s=1.0)
    assert time.monotonic() - t0 < 30
    assert out[0] == "ok" and "peer timed out" in str(out[1])
    assert isinstance(out[2], TimeoutError) and "w2" in str(out[2])
    ray.kill(c)
    # without a failure, every step is waited for
    out = collect_steps(ray, {0: a.run.remote("x"), 1: b.run.remote("y")}, {0: "w0", 1: "w1"},
                        grace_s=0.0)
    assert out == {0: "x", 1: "y"}
