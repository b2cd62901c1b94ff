"""RayGroup with a worker actor that hangs: its process is stopped (SIGSTOP) before the job,
so its first step never ends. The group must find it hung after its step timeout, kill it and
report it dead, so the scheduler re-runs its sequences on the worker left (or fails them
where none is left) instead of waiting forever."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from cluster.scheduler import Scheduler
from runtime_helpers import prepared
from workers.actor import LocalGroup, RayGroup, Worker, WorkerSpec
from workers.tokenizer import Tokenizer

N = 8


def items():
    rng = np.random.default_rng(5)
    return [prepared(i, rng.integers(5, 500, size=int(rng.integers(2, 20))), max_tokens=6)
            for i in range(N)]


def generate(group, tiny):
    tok = Tokenizer.from_dir(tiny)
    results = []
    stats = Scheduler(group, max_context=64, prefill_chunk=32, eos_ids=tok.eos_ids,
                      decode=tok.decode, tier="f32").run(items(), results.append)
    return {r.id: r for r in results}, stats


def spec(tiny, name):
    return WorkerSpec(name, str(tiny), "f32", 3, 64)


def generate_with_one_stopped(group, i, tiny):
    """Stop worker i's process (it hangs: takes calls, runs none), run the job on the group
    and close it; returns (results, stats, seconds the job took, the stopped pid). Should the
    group fail to end the process, it is killed here (our own actor)."""
    pid = group.info[i]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got, stats = generate(group, tiny)
        took = time.monotonic() - t0
        group.close()
    finally:
        if not gone(pid, 0):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    return got, stats, took, pid


def gone(pid, within_s=30.0) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def test_hung_worker_is_killed_and_its_sequences_rerun_on_the_other(ray, tiny):
    ref, _ = generate(LocalGroup([Worker(spec(tiny, "w"))]), tiny)
    group = RayGroup([(spec(tiny, "a"), {"num_cpus": 0.5}), (spec(tiny, "b"), {"num_cpus": 0.5})],
                     step_timeout_s=3.0)
    got, stats, took, pid = generate_with_one_stopped(group, 1, tiny)
    assert took < 60, took
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].finish_reason != "error", got[k].error
        assert got[k].completion_tokens == ref[k].completion_tokens, k
    assert {r.worker for r in got.values()} == {"a"}  # b's first 3 moved to a
    assert group.hung == {1}
    assert stats.worker_deaths == 1 and stats.recoveries == 1 and stats.requeued == 3
    assert gone(pid)  # the hung process was killed, not left behind


def test_a_lone_hung_worker_fails_its_requests_after_the_step_timeout(ray, tiny):
    group = RayGroup([(spec(tiny, "a"), {"num_cpus": 0.5})], step_timeout_s=3.0)
    got, stats, took, pid = generate_with_one_stopped(group, 0, tiny)
    assert 3 <= took < 60, took  # the step timeout
    assert len(got) == N
    assert all(r.finish_reason == "error" and r.error == "no live worker left"
               for r in got.values())
    assert stats.worker_deaths == 1 and stats.recoveries == 0 and stats.requeued == 0
    assert gone(pid)
