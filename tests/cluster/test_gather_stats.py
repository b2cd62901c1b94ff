"""workers/actor.gather_stats, the stats call of RayGroup and ShardedGroup (the expert gauges
and a job's final per-worker figures): with one actor SIGKILLed since its last call, the live
ones' stats still come back and the dead one is named in a warning. (ShardedGroup asked all
of them in one ray.get: one death lost every worker's figures, final_stats included.)"""
from __future__ import annotations

import logging
import os
import signal
import time

from workers.actor import gather_stats


def test_a_dead_actor_is_left_out_with_a_warning(ray, caplog):
    @ray.remote(num_cpus=0)
    class Probe:
        def __init__(self, name):
            self.name = name

        def pid(self):
            return os.getpid()

        def stats(self):
            return {"name": self.name, "pid": os.getpid()}

    names = ["w0", "w1", "w2"]
    actors = [Probe.remote(n) for n in names]
    pids = ray.get([a.pid.remote() for a in actors])
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(0.5)
    with caplog.at_level(logging.WARNING, logger="workers.actor"):
        got = gather_stats(actors, names, dead=set(), timeout_s=20)
    assert [s["name"] for s in got] == ["w0", "w2"]
    assert [s["pid"] for s in got] == [pids[0], pids[2]]
    warned = [r.getMessage() for r in caplog.records if "stats unavailable" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("worker w1: stats unavailable: ")
    # a worker a step already found dead is not asked at all
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="workers.actor"):
        assert [s["name"] for s in gather_stats(actors, names, dead={1})] == ["w0", "w2"]
    assert not caplog.records
    for a in actors:
        ray.kill(a)
