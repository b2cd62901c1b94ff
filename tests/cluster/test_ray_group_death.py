"""RayGroup (replicated experts) with a worker actor SIGKILLed mid-job, right after one of
its steps: a real death, its process gone with the KV of its sequences. The expert gauges'
stats call meets it dead first (a warning; the job goes on), its next step fails, and its
sequences are re-run from their prompts on the survivor. What the job reports must count
each delivered token once (SchedulerStats.tokens / decode_tokens) and the lost ones apart
(rerun_tokens), and the expert gauges must show the replicated workers' experts."""
from __future__ import annotations

import logging
import os
import signal

import numpy as np

from cluster.metrics import JobMetrics
from cluster.scheduler import Scheduler
from runtime_helpers import prepared
from workers.actor import RayGroup, WorkerSpec
from workers.tokenizer import Tokenizer

N = 8
KILL_AFTER = 4  # the victim's sequences sampled a token in each of these steps


def items():
    rng = np.random.default_rng(11)
    return [prepared(i, rng.integers(5, 500, size=int(rng.integers(2, 20))), max_tokens=14)
            for i in range(N)]


class Tape:
    """Every step the scheduler ran: each successful worker's sampled (key, token, ended)
    and whether the step was decode-only (no prompt rows in any worker's batch), so the
    test can count on its own which tokens were delivered and which died with the victim."""

    def __init__(self, group, victim: int, eos):
        self.group, self.victim, self.eos = group, victim, set(eos)
        self.steps, self.victim_keys, self.killed = [], set(), None
        self._real = group.step_all
        group.step_all = self.step_all

    def step_all(self, batches):
        out = self._real(batches)
        if all(len(b.keys) == 0 for b in batches.values()):
            return out  # a release-only step: nothing sampled
        decode = all(len(b.tokens) == len(b.sample_at) for b in batches.values())
        sampled = []
        for w, b in batches.items():
            if w == self.victim:
                self.victim_keys.update(np.asarray(b.keys).tolist())
            if isinstance(out[w], BaseException):
                continue
            keys = np.asarray(b.keys)[np.asarray(b.sample_at)].tolist()
            last = b.last.tolist() if len(b.last) else [False] * len(keys)
            for k, t, end in zip(keys, out[w].next_tokens.tolist(), last):
                sampled.append((k, end or t in self.eos))
        self.steps.append((decode, sampled))
        if len(self.steps) == KILL_AFTER:  # dies between this step and the next
            self.killed = self.group.info[self.victim]["pid"]
            os.kill(self.killed, signal.SIGKILL)
        return out

    def counts(self):
        """(delivered tokens, of them in decode-only steps, tokens lost with the victim)."""
        ended = {k for _, s in self.steps for k, end in s if end}
        lost = self.victim_keys - ended  # its sequences still running when it died
        n = lambda pick: sum(1 for d, s in self.steps for k, _ in s if pick(d, k))
        return (n(lambda d, k: k not in lost), n(lambda d, k: d and k not in lost),
                n(lambda d, k: k in lost))


def test_a_killed_workers_rerun_tokens_count_once_and_the_gauges_skip_it(ray, tiny, caplog):
    tok = Tokenizer.from_dir(tiny)
    group = RayGroup([(WorkerSpec(n, str(tiny), "f32", 3, 96), {"num_cpus": 0.5})
                      for n in ("a", "b")])
    tape = Tape(group, victim=1, eos=tok.eos_ids)
    m = JobMetrics(use_ray=False)
    sched = Scheduler(group, max_context=96, prefill_chunk=32, eos_ids=tok.eos_ids,
                      decode=tok.decode, tier="f32", metrics=m)
    sched.gauges.every_s = 0.0  # every iteration: the one right after the kill meets it dead
    results = []
    caplog.set_level(logging.WARNING)
    try:
        stats = sched.run(items(), results.append)
    finally:
        group.close()
    assert tape.killed is not None and len(tape.steps) > KILL_AFTER
    assert len(results) == N and not any(r.error for r in results)
    assert stats.worker_deaths == 1 and stats.requeued >= 1
    delivered, decode, lost = tape.counts()
    assert lost > 0 and decode < delivered  # the victim's sequences had sampled tokens
    # each delivered token once: what the results hold (EOS is counted, not in the text)
    assert stats.tokens == delivered == sum(
        r.completion_token_count + (r.finish_reason == "stop") for r in results)
    assert stats.decode_tokens == decode
    assert stats.rerun_tokens == lost
    # the counter is a work rate: every token sampled, the lost ones too, which it has apart
    assert m.local["tokens_generated"] == delivered + lost
    assert m.local["tokens_rerun"] == lost
    # the expert gauges of the replicated workers: all 2 MoE layers x 8 experts each, in host
    # memory, every pick served locally; b's stats call after its death only warned
    for name in ("a", "b"):
        assert m.local[f"expert_pins[{name}]"] == 16
        assert m.local[f"expert_pins_host[{name}]"] == 16
        assert m.local[f"expert_hit_rate[{name}]"] == 1.0
    assert any("worker b" in r.getMessage() and "stats" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING), caplog.text
    assert [s["name"] for s in group.final_stats] == ["a"]  # the survivor's, at close


def test_a_worker_dead_while_loading_counts_once_and_gets_no_sequence(ray, tiny, tmp_path):
    """RayGroup (replicated experts) with worker b's model load failing (its actor dies
    before the first step), as ShardedGroup: b gets no slots, so no sequence is sent to die
    there and be re-run, and the job's stats and metrics count its death and the recovery,
    once. It kept its slots: the first step's sequences there failed and were re-queued, and
    a job whose sequences all went to a (its lower index wins a tie) counted no death at all."""
    tok = Tokenizer.from_dir(tiny)
    group = RayGroup([(WorkerSpec("a", str(tiny), "f32", 3, 96), {"num_cpus": 0.5}),
                      (WorkerSpec("b", str(tmp_path / "no-such-model"), "f32", 3, 96),
                       {"num_cpus": 0.5})])
    try:
        assert group.info[1] is None and group.dead_at_start == [1] and group.capacities == [3, 0]
        for n in (1, N):  # one request: a takes it by index; N: more than a's slots
            m, results = JobMetrics(use_ray=False), []
            stats = Scheduler(group, max_context=96, prefill_chunk=32, eos_ids=tok.eos_ids,
                              decode=tok.decode, tier="f32", metrics=m).run(items()[:n],
                                                                             results.append)
            assert len(results) == n and not any(r.error for r in results)
            assert {r.worker for r in results} == {"a"}
            assert (stats.worker_deaths, stats.recoveries, stats.requeued) == (1, 1, 0), n
            assert m.local["worker_deaths"] == 1 and m.local["requests_requeued"] == 0
        assert [s["name"] for s in group.worker_stats()] == ["a"]  # b's not asked for
    finally:
        group.close()
