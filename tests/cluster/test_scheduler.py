"""Scheduler: continuous batching, chunked prefill, ragged decode, stop rules, several workers.

The fake model (scheduler_fakes.py) hashes each slot's full token history, so any slip in
positions, slots or chunks changes the outputs or raises."""
from __future__ import annotations


import numpy as np
import pytest

from cluster.metrics import JobMetrics
from cluster.requests import Request
from cluster.scheduler import Prepared, Scheduler
from scheduler_fakes import EOS, FakeModel, FakePool, decode
from workers.actor import LocalGroup, Worker, WorkerSpec
from workers.sampling import sample_rows

MAX_CTX = 64


def make_group(capacities, max_ctx=MAX_CTX, eos_bias=0.0):
    workers = [Worker(WorkerSpec(f"w{i}", "fake", "f32", c, max_ctx),
                      model=FakeModel(eos_bias=eos_bias), pool=FakePool(c, max_ctx))
               for i, c in enumerate(capacities)]
    return LocalGroup(workers)


def prompts(n=16, seed=3):
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.arange(1, 3 * n, 3))[:n]  # all different, 1..46
    return [rng.integers(1, 40, size=int(L)).astype(np.int32) for L in lengths]


def prep(i, ids, max_tokens=12, temperature=0.0, stop=(), seed=0):
    return Prepared(Request(id=f"r{i}", line=i + 1), np.asarray(ids, np.int32), max_tokens,
                    temperature, 1.0 if temperature == 0 else 0.9, seed, stop)


def run(group, items, prefill_chunk=7, max_ctx=MAX_CTX, metrics=None):
    results = []
    sched = Scheduler(group, max_context=max_ctx, prefill_chunk=prefill_chunk, eos_ids=[EOS],
                      decode=decode, tier="f32", metrics=metrics)
    stats = sched.run(items, results.append)
    for w in group.workers:  # every slot handed back
        assert not w.pool.used.any(), w.pool.used
    return {r.id: r for r in results}, stats


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_slots_1_and_8_give_identical_outputs(temperature):
    items = [prep(i, p, temperature=temperature, seed=i) for i, p in enumerate(prompts())]
    one, _ = run(make_group([1]), items)
    eight, stats = run(make_group([8]), items)
    assert len(one) == 16
    for k in one:
        assert one[k].completion_tokens == eight[k].completion_tokens, k
        assert one[k].finish_reason == eight[k].finish_reason
        assert one[k].prompt_token_count == len(items[int(k[1:])].prompt_ids)
    # slots=8 really batched: some decode step carried more than one sequence
    assert stats.decode_steps > 0 and stats.decode_tokens > stats.decode_steps


def test_prefill_is_chunked_and_batched_with_decode():
    group = make_group([4])
    items = [prep(i, p) for i, p in enumerate(prompts(6))]
    run(group, items, prefill_chunk=5)
    calls = group.workers[0].model.calls
    assert max(n - m for n, m in calls) <= 5 + 4  # prompt tokens per step <= chunk (+ decodes)
    assert any(m > 1 and n > m for n, m in calls)  # a step mixing prefill rows and decodes


def test_prompt_alone_or_among_others_in_any_order():
    ps = prompts(9, seed=11)
    target = prep(0, ps[0], max_tokens=20)
    alone, _ = run(make_group([8]), [target])
    others = [prep(i, p, max_tokens=5 + i) for i, p in enumerate(ps[1:], start=1)]
    rng = np.random.default_rng(0)
    for _ in range(4):
        mixed = others + [target]
        rng.shuffle(mixed)
        got, _ = run(make_group([8]), mixed, prefill_chunk=int(rng.integers(1, 20)))
        assert got["r0"].completion_tokens == alone["r0"].completion_tokens


def test_several_workers_match_one_and_share_by_free_capacity():
    items = [prep(i, p) for i, p in enumerate(prompts())]
    ref, _ = run(make_group([8]), items)
    group = make_group([2, 5, 1])
    got, _ = run(group, items)
    for k in ref:
        assert got[k].completion_tokens == ref[k].completion_tokens
    first8 = [got[f"r{i}"].worker for i in range(8)]  # admitted together at the start
    assert first8.count("w0") == 2 and first8.count("w1") == 5 and first8.count("w2") == 1


def test_stop_rules():
    ps = prompts(12, seed=5)
    # EOS: a strong EOS bias makes most sequences stop early, and EOS is not in the output
    res, _ = run(make_group([4], eos_bias=2.5), [prep(i, p, max_tokens=30) for i, p in
                                                 enumerate(ps)])
    stopped = [r for r in res.values() if r.finish_reason == "stop"]
    assert stopped and all(EOS not in r.completion_tokens for r in res.values())
    # max_tokens
    res, _ = run(make_group([4]), [prep(0, ps[0], max_tokens=3)])
    assert res["r0"].finish_reason in ("length", "stop")
    if res["r0"].finish_reason == "length":
        assert res["r0"].completion_token_count == 3
    # context: prompt of 60 in a 64-token context yields at most 4 tokens
    long = np.arange(1, 61) % 39 + 1
    res, _ = run(make_group([2], eos_bias=-50), [prep(0, long, max_tokens=50)])
    assert res["r0"].finish_reason == "length" and res["r0"].completion_token_count == 4
    # stop string: take the text of a free run and stop at a substring of it
    free, _ = run(make_group([2], eos_bias=-50), [prep(0, ps[1], max_tokens=10)])
    text = free["r0"].completion
    stop = text[4:6]
    first = text.find(stop)
    res, _ = run(make_group([2], eos_bias=-50), [prep(0, ps[1], max_tokens=10, stop=(stop,))])
    assert res["r0"].finish_reason == "stop" and res["r0"].completion == text[:first]


def test_metrics_and_stats_are_recorded():
    m = JobMetrics(use_ray=False)
    items = [prep(i, p) for i, p in enumerate(prompts(5))]
    res, stats = run(make_group([3]), items, metrics=m)
    n = sum(r.completion_token_count + (r.finish_reason == "stop") for r in res.values())
    assert m.local["tokens_generated"] == stats.tokens == n
    assert m.local["ttft_count"] == 5 and m.local["queue_depth"] == 0
    # after the run the gauges show nothing in flight (they kept the last step's values)
    assert m.local["active_slots"] == 0 and m.local["decode_tokens_per_s"] == 0
    kv = {k: v for k, v in m.local.items() if k.startswith("kv_bytes_in_use")}
    assert kv and all(v == 0 for v in kv.values()), kv
    assert stats.overhead_per_decode_step_s >= 0
    assert all(r.ttft_s is not None and r.ttft_s >= 0 for r in res.values())


def test_sampling_rows_reference():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((64, 30)).astype(np.float32)
    temp = np.where(np.arange(64) % 2, 0.7, 0.0).astype(np.float32)
    top_p = np.full(64, 0.5, np.float32)
    seed, counter = np.arange(64, dtype=np.uint64), np.full(64, 3, np.uint64)
    got = sample_rows(logits, temp, top_p, seed, counter)
    assert np.array_equal(got[::2], logits[::2].argmax(-1))
    # hot rows: the pick is inside the nucleus, and the same with the rows alone or reversed
    for r in range(1, 64, 2):
        p = np.exp((logits[r] - logits[r].max()) / 0.7)
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        nucleus = order[:np.searchsorted(np.cumsum(p[order]), 0.5) + 1]
        assert got[r] in nucleus
    rev = sample_rows(logits[::-1], temp[::-1], top_p, seed[::-1], counter)
    assert np.array_equal(rev[::-1], got)
    # the draws are spread: over many counters a flat row hits many tokens
    flat = np.zeros((500, 30), np.float32)
    picks = sample_rows(flat, np.ones(500, np.float32), np.ones(500, np.float32),
                        np.zeros(500, np.uint64), np.arange(500, dtype=np.uint64))
    assert len(set(picks.tolist())) > 25
    # and follow the distribution: 3000 draws of one row at temperature 1
    row = np.log(np.array([[0.6, 0.3, 0.1]], np.float32)).repeat(3000, 0)
    draws = sample_rows(row, np.ones(3000, np.float32), np.ones(3000, np.float32),
                        np.full(3000, 7, np.uint64), np.arange(3000, dtype=np.uint64))
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 3000, [0.6, 0.3, 0.1], atol=0.03)



def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p=1e-46 is valid (in (0, 1]) but is 0 as the float32 the scheduler sends; the
    nucleus then kept no token and the draw fell to the least likely one."""
    logits = np.array([[5.0, 1.0, 0.0, -3.0]] * 8, np.float32)
    for top_p in (np.float32(1e-46), 0.0, 1e-9):
        got = sample_rows(logits, np.ones(8, np.float32), np.full(8, top_p, np.float32),
                          np.arange(8, dtype=np.uint64), np.arange(8, dtype=np.uint64))
        assert got.tolist() == [0] * 8, top_p


# -- the real tiny model through the real KV pool, per tier ---------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from runtime_helpers import make_tiny
    from workers.model import Model
    from workers.tokenizer import Tokenizer
    d = make_tiny(tmp_path_factory.mktemp("tiny"))
    return Model.load(d), Tokenizer.from_dir(d)


def run_real(tiny_model, tier, slots, items, prefill_chunk, max_ctx=96):
    model, tok = tiny_model
    group = LocalGroup([Worker(WorkerSpec("w0", "tiny", tier, slots, max_ctx), model=model)])
    results = []
    Scheduler(group, max_context=max_ctx, prefill_chunk=prefill_chunk, eos_ids=tok.eos_ids,
              decode=tok.decode, tier=tier).run(items, results.append)
    assert group.workers[0].pool.free_slots() == slots  # all slots handed back
    return {r.id: r.completion_tokens for r in results}


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
def test_real_model_slots_1_and_8_identical(tiny_model, tier):
    rng = np.random.default_rng(0)
    lengths = rng.permutation(np.arange(1, 33, 2))  # 16 different lengths
    items = [prep(i, rng.integers(5, 500, size=int(L)), max_tokens=5)
             for i, L in enumerate(lengths)]
    one = run_real(tiny_model, tier, 1, items, prefill_chunk=64)
    eight = run_real(tiny_model, tier, 8, items, prefill_chunk=9)
    assert len(one) == 16 and one == eight


def test_real_model_prompt_alone_or_among_others(tiny_model):
    rng = np.random.default_rng(4)
    target = prep(0, rng.integers(5, 500, size=13), max_tokens=8)
    alone = run_real(tiny_model, "f32", 8, [target], prefill_chunk=64)["r0"]
    others = [prep(i, rng.integers(5, 500, size=int(rng.integers(1, 30))), max_tokens=3 + i % 4)
              for i in range(1, 9)]
    for order in (others + [target], [target] + others[::-1]):
        got = run_real(tiny_model, "f32", 8, order, prefill_chunk=int(rng.integers(4, 40)))
        assert got["r0"] == alone


class FailingGroup(LocalGroup):
    """Worker `victim` fails its step number `at`: dies (Ray actor death) or just raises."""

    def __init__(self, workers, victim: int, at: int, dies: bool):
        super().__init__(workers)
        self.victim, self.at, self.dies, self.steps = victim, at, dies, 0

    def step_all(self, batches):
        self.steps += 1
        out = super().step_all(batches)  # the victim did the step's work, then failed
        if self.steps == self.at and self.victim in batches:
            out[self.victim] = RuntimeError("boom")
        return out

    def is_dead(self, worker, exc):
        return self.dies


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_dead_worker_requests_rerun_elsewhere_with_same_tokens(temperature):
    items = [prep(i, p, temperature=temperature, seed=i) for i, p in enumerate(prompts())]
    ref, _ = run(make_group([8]), items)
    base = make_group([3, 3])
    group = FailingGroup(base.workers, victim=1, at=6, dies=True)
    results = []
    Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
              tier="f32").run(items, results.append)
    got = {r.id: r for r in results}
    assert len(results) == 16 and set(got) == set(ref)
    for k in ref:
        assert got[k].completion_tokens == ref[k].completion_tokens, k
        assert got[k].finish_reason != "error"
    late = [r for r in results[6:]]
    assert late and all(r.worker == "w0" for r in late)  # nothing admitted to the dead one


def test_rerun_requests_count_one_first_token_each():
    """The victim dies after its sequences sampled tokens: their re-run elsewhere samples a
    first token again, which the TTFT histogram must not count twice."""
    items = [prep(i, p, seed=i) for i, p in enumerate(prompts())]
    group = FailingGroup(make_group([3, 3]).workers, victim=1, at=12, dies=True)
    m = JobMetrics(use_ray=False)
    results = []
    Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
              tier="f32", metrics=m).run(items, results.append)
    assert len(results) == 16 and m.local["ttft_count"] == 16


@pytest.mark.parametrize("survivor, at", [(True, 12), (False, 30)])
def test_tokens_a_dead_worker_took_with_it_count_apart(survivor, at):
    """The victims die after their sequences sampled tokens (a real death on Ray:
    test_ray_group_death.py). stats.tokens counted those tokens, and again when the re-run
    sampled them; now it counts what the results deliver and rerun_tokens the lost ones
    (where nobody is left to re-run them too: those requests fail with no tokens)."""
    class Dies(FailingGroup):
        def step_all(self, batches):
            out = super().step_all(batches)
            if not survivor and self.steps == self.at:
                out = {w: RuntimeError("actor died") for w in out}
            return out

    items = [prep(i, p, seed=i) for i, p in enumerate(prompts())]
    group = Dies(make_group([3, 3]).workers, victim=1, at=at, dies=True)
    m, results = JobMetrics(use_ray=False), []
    stats = Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
                      tier="f32", metrics=m).run(items, results.append)
    assert len(results) == 16 and stats.worker_deaths == (1 if survivor else 2)
    assert any(r.error for r in results) != survivor
    delivered = sum(r.completion_token_count + (r.finish_reason == "stop") for r in results)
    assert stats.tokens == delivered and 0 < stats.decode_tokens < stats.tokens
    assert any(not r.error for r in results)  # (some had ended before the deaths)
    assert stats.rerun_tokens > 0
    assert m.local["tokens_generated"] == stats.tokens + stats.rerun_tokens  # every one sampled
    assert m.local["tokens_rerun"] == stats.rerun_tokens


def test_failed_step_fails_only_that_workers_sequences():
    items = [prep(i, p) for i, p in enumerate(prompts())]
    ref, _ = run(make_group([8]), items)
    base = make_group([3, 3])
    group = FailingGroup(base.workers, victim=1, at=4, dies=False)
    results = []
    Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
              tier="f32").run(items, results.append)
    errs = [r for r in results if r.finish_reason == "error"]
    assert 1 <= len(errs) <= 3 and all("boom" in r.error and r.worker == "w1" for r in errs)
    assert len(results) == 16
    for r in results:
        if r.finish_reason != "error":
            assert r.completion_tokens == ref[r.id].completion_tokens
    for w in base.workers:  # the failed sequences' slots were released too
        assert not w.pool.used.any()
    assert group.steps > 4


def test_failed_step_spares_the_workers_sequences_not_in_it():
    """Four sequences on the worker, but the prefill budget puts only r0's first chunk in
    step 1, which raises: r0 fails, the three waiting their turn run on (all four failed)."""
    rng = np.random.default_rng(2)
    items = [prep(i, rng.integers(1, 40, size=10)) for i in range(4)]
    ref, _ = run(make_group([4]), items, prefill_chunk=3)
    base = make_group([4])
    results = []
    Scheduler(FailingGroup(base.workers, victim=0, at=1, dies=False), max_context=MAX_CTX,
              prefill_chunk=3, eos_ids=[EOS], decode=decode, tier="f32").run(items, results.append)
    got = {r.id: r for r in results}
    assert len(results) == 4 and got["r0"].finish_reason == "error"
    for k in ("r1", "r2", "r3"):
        assert got[k].finish_reason != "error" and got[k].completion_tokens == ref[k].completion_tokens
    assert not base.workers[0].pool.used.any()

def test_a_release_that_raises_still_frees_the_slots():
    """Saving a finished sequence's KV raises once in Worker.step's release loop: that slot
    (and any released after it in the batch) stayed taken, the pool filled up and every
    later step on the worker failed with 'pool full'. Now only that step's sequences fail."""
    rng = np.random.default_rng(0)
    items = [prep(i, rng.integers(1, 40, size=3), max_tokens=2 + i % 2) for i in range(12)]
    group = make_group([2])
    w = group.workers[0]
    release, calls = w.persist.release, []

    def flaky(key, pool, slot, save=True):
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("saving KV failed")
        release(key, pool, slot, save=save)

    w.persist.release = flaky
    res, _ = run(group, items)  # (checks that every slot was handed back)
    errs = [r for r in res.values() if r.finish_reason == "error"]
    assert len(res) == 12 and 1 <= len(errs) <= 2
    assert all("saving KV failed" in r.error for r in errs)

def test_row_decode_rate_ignores_the_eos_token():
    """One token per (virtual) second, then EOS: the row's rate is 1 token/s, as the job's;
    EOS is not in the completion, so its sampling time is not the last token's."""
    from cluster.scheduler import Prepared
    from cluster.requests import Request
    from workers.actor import StepOutput

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock, script = Clock(), iter([5, 6, 7, EOS])

    class Scripted:
        names, capacities, dead_at_start = ["w0"], [1], []

        def step_all(self, batches):
            clock.t += 1.0
            return {w: StepOutput(next_tokens=np.array([next(script) for _ in b.sample_at],
                                                       np.int32), forward_s=1.0, step_s=1.0,
                                  kv_bytes=0) for w, b in batches.items()}

    res = []
    Scheduler(Scripted(), max_context=64, prefill_chunk=64, eos_ids=[EOS], decode=decode,
              tier="f32", clock=clock).run(
        [Prepared(Request(id="a", line=1), np.array([1, 2, 3], np.int32), 10, 0.0, 1.0, 0)],
        res.append)
    assert res[0].finish_reason == "stop" and res[0].completion_tokens == [5, 6, 7]
    assert res[0].decode_tokens_per_s == pytest.approx(1.0)


def test_no_live_slot_left_fails_the_waiting_requests():
    """Worker 1 died while starting (the group set its capacity to 0 and lists it in
    dead_at_start) and worker 0 dies mid-job: its requests and the rest come out as error rows
    (they were dropped without a result); both deaths count, a recovery only the first (worker
    0 was left to go on with)."""
    items = [prep(i, p, seed=i) for i, p in enumerate(prompts())]
    base = make_group([3, 3])
    group = FailingGroup(base.workers, victim=0, at=4, dies=True)
    group.capacities[1], group.dead_at_start = 0, [1]
    results = []
    stats = Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
                      tier="f32").run(items, results.append)
    assert sorted(r.id for r in results) == sorted(it.req.id for it in items)
    failed = [r for r in results if r.finish_reason == "error"]
    assert failed and all(r.error == "no live worker left" for r in failed)
    assert stats.worker_deaths == 2 and stats.recoveries == 1


@pytest.mark.parametrize("requests", [1, 16])
def test_deaths_while_loading_count_once_with_those_of_steps(requests):
    """Workers the group found dead while loading (dead_at_start: no slots, never stepped;
    cluster/ep_group.py moved their experts) count in the stats and metrics as a step's
    deaths do, once each, with a recovery each where a live worker is left, and nothing
    re-queued; a later death in a step counts on top. They counted nowhere: the soak took
    such a kill for one of an idle worker, never found (runner.classify_kills "unseen")."""
    items = [prep(i, p, seed=i) for i, p in enumerate(prompts())][:requests]
    ref, _ = run(make_group([8]), items)
    base = make_group([2, 3, 4, 3])
    group = FailingGroup(base.workers, victim=3, at=3, dies=True)
    group.capacities[0] = group.capacities[2] = 0
    group.dead_at_start = [0, 2]
    m, results = JobMetrics(use_ray=False), []
    stats = Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
                      tier="f32", metrics=m).run(items, results.append)
    assert {r.id: r.completion_tokens for r in results} == {k: r.completion_tokens
                                                           for k, r in ref.items()}
    assert not any(r.error for r in results) and {r.worker for r in results} <= {"w1", "w3"}
    step_death = 1 if requests > 3 else 0  # (w3 gets a sequence only past w1's free share)
    assert stats.worker_deaths == 2 + step_death == m.local["worker_deaths"]
    assert stats.recoveries == 2 + step_death
    assert (stats.requeued > 0) == bool(step_death) and stats.requeued == m.local["requests_requeued"]


def test_workers_dying_in_one_step_count_no_recovery_when_none_is_left():
    """Both workers die in the same step (RayGroup keeps their capacities): the first death
    counted as recovered because the second was not yet marked dead."""
    class AllDie(LocalGroup):
        steps = 0

        def step_all(self, batches):
            self.steps += 1
            out = super().step_all(batches)
            return {w: RuntimeError("actor died") for w in out} if self.steps == 3 else out

        def is_dead(self, worker, exc):
            return True

    items = [prep(i, p, seed=i) for i, p in enumerate(prompts(6))]
    results = []
    stats = Scheduler(AllDie(make_group([3, 3]).workers), max_context=MAX_CTX, prefill_chunk=7,
                      eos_ids=[EOS], decode=decode, tier="f32").run(items, results.append)
    assert sorted(r.id for r in results) == sorted(it.req.id for it in items)
    assert all(r.error == "no live worker left" for r in results)
    assert stats.worker_deaths == 2 and stats.recoveries == 0
    assert stats.requeued == 0  # (none re-run: they counted as requeued before)

class ReleasingNow(Scheduler):
    """Every stop-string end freed in the iteration's release-only step, as for requests
    with a saved-KV cache (Scheduler._release_now)."""
    @staticmethod
    def _release_now(s):
        return True


def test_a_worker_dying_in_a_release_only_step_is_counted_and_recovered():
    """r0 ends at a stop string (the worker cannot see it), so its slot is freed by a
    release-only step right after (as for a request with a saved-KV cache), which meets r0's
    worker dead: the death counts and that worker's other sequences re-run on the other with
    the same tokens."""
    class DiesInARelease(LocalGroup):
        died = False

        def step_all(self, batches):
            out = super().step_all(batches)
            if not self.died and all(len(b.keys) == 0 for b in batches.values()):
                self.died = True
                return {w: RuntimeError("actor died") for w in out}
            return out

        def is_dead(self, worker, exc):
            return isinstance(exc, RuntimeError) and str(exc) == "actor died"

    ps = prompts(6, seed=4)
    free, _ = run(make_group([2, 2], eos_bias=-50), [prep(i, p, max_tokens=10)
                                                      for i, p in enumerate(ps)])
    stop = free["r0"].completion[3:5]
    items = [prep(i, p, max_tokens=10, stop=(stop,) if i == 0 else ()) for i, p in enumerate(ps)]
    ref, _ = run(make_group([2, 2], eos_bias=-50), items)
    assert ref["r0"].completion_token_count < 10  # r0 did end at its stop string
    base = make_group([2, 2], eos_bias=-50)
    group, results, m = DiesInARelease(base.workers), [], JobMetrics(use_ray=False)
    stats = ReleasingNow(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS],
                         decode=decode, tier="f32", metrics=m).run(items, results.append)
    assert group.died
    got = {r.id: r for r in results}
    assert set(got) == set(ref) and not any(r.error for r in results)
    for k in ref:
        assert got[k].completion_tokens == ref[k].completion_tokens, k
    assert stats.worker_deaths == 1 and stats.recoveries == 1 and stats.requeued >= 1
    assert m.local["worker_deaths"] == 1
    live = base.workers[1 - int(got["r0"].worker[1:])]
    assert not live.pool.used.any()  # the survivor handed back every slot


def test_the_stats_say_when_the_last_step_was_taken():
    """steps_done_at: the Unix time once run() has taken its last step (the final
    release-only one included), so the soak can tell a worker killed after it (nothing left to
    run: no death found, no recovery) from a kill the job had to recover from."""
    import time

    class Timed(LocalGroup):
        last = None

        def step_all(self, batches):
            out = super().step_all(batches)
            self.last = time.time()
            return out

    ps = prompts(6, seed=4)
    free, _ = run(make_group([2]), [prep(i, p, max_tokens=10) for i, p in enumerate(ps)])
    stop = free["r0"].completion[3:5]  # r0's slot is freed by a release-only step at the end
    items = [prep(i, p, max_tokens=10, stop=(stop,) if i == 0 else ()) for i, p in enumerate(ps)]
    group = Timed(make_group([2]).workers)
    res, stats = run(group, items)
    assert group.last is not None and group.last <= stats.steps_done_at <= time.time()
    assert run(make_group([2]), [])[1].steps_done_at is not None  # (no step at all)


def test_decode_rate_gauge_follows_decode_only_steps():
    m = JobMetrics(use_ray=False)
    m.step(40, 1.0)
    m.step(3, 1.0, decode=False)  # a step with prefill rows: few tokens, a long step
    assert m.local["decode_tokens_per_s"] == 40 and m.local["tokens_generated"] == 43


def test_a_result_comes_after_its_slot_is_freed_with_no_extra_step_in_the_common_case():
    """One slot, so nothing else holds it when a Result goes out. EOS and length ends are
    freed by the worker at the end of the finishing step: free at the Result, no extra call.
    A stop-string end (the worker cannot see it) of a request with a saved-KV cache costs one
    release-only call, so it is free at the Result too; without a cache it is freed with the
    worker's next batch or at the job's end, at no extra call."""
    class Counting(LocalGroup):
        calls = 0

        def step_all(self, batches):
            self.calls += 1
            return super().step_all(batches)

    ps = prompts(8, seed=6)
    free, _ = run(make_group([1], eos_bias=-50), [prep(0, ps[0], max_tokens=10)])
    stop = free["r0"].completion[2:4]
    group = Counting(make_group([1], eos_bias=1.5).workers)
    pool = group.workers[0].pool
    reasons = []

    def on_result(r):
        assert not pool.used.any(), (r.id, r.finish_reason)
        reasons.append(r.finish_reason)

    items = [prep(i, p, max_tokens=4, seed=i) for i, p in enumerate(ps)]
    stats = Scheduler(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
                      tier="f32").run(items, on_result)
    assert {"stop", "length"} <= set(reasons) and len(reasons) == 8
    assert group.calls == stats.steps  # EOS and length ends: not one call more
    group = Counting(make_group([1], eos_bias=-50).workers)
    pool = group.workers[0].pool
    res = []
    stats = ReleasingNow(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS],
                         decode=decode, tier="f32").run(
        [prep(0, ps[0], max_tokens=10, stop=(stop,))], lambda r: (on_result(r), res.append(r)))
    assert res[0].finish_reason == "stop" and res[0].completion_token_count < 10
    assert group.calls == stats.steps + 1  # the stop string's release-only call
    # three such requests in a row through the one slot: with a cache, a release-only call
    # each; without, each rides on the next request's first batch, and the last is freed by
    # the job's closing release: still held at its Result, free once the job has ended
    three = [prep(i, ps[0], max_tokens=10, stop=(stop,)) for i in range(3)]
    for sched, extra in ((ReleasingNow, 3), (Scheduler, 1)):
        group = Counting(make_group([1], eos_bias=-50).workers)
        pool = group.workers[0].pool
        held = []
        stats = sched(group, max_context=MAX_CTX, prefill_chunk=7, eos_ids=[EOS], decode=decode,
                      tier="f32").run(three, lambda r: held.append((r.finish_reason, pool.used.any())))
        assert [h[0] for h in held] == ["stop"] * 3
        assert group.calls == stats.steps + extra, sched
        assert all(h[1] for h in held) == (sched is Scheduler)
        assert not pool.used.any()
