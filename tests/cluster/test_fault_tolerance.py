"""A worker actor killed mid-job (ray.kill from the test while the generate job runs on a
three-node cluster, experts sharded): every id comes out exactly once with the single
worker's completions, the dead worker's requests were re-queued, its experts moved to the
survivors, and the job's stats count it."""
from __future__ import annotations

import logging
import threading
import time

import pyarrow.parquet as pq
import pytest

from cluster.jobs.generate import run_generate
from fleet_cluster import fleet_yaml, start_cluster, stop_cluster
from runtime_helpers import job_config, prompt_lines, rows_by_id, write_lines

N = 20
VICTIM = "cuda-b/cuda0"


def config(tiny, **kw):
    return job_config(tiny, flush_every=2, **kw)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_lines(tmp_path_factory.mktemp("p") / "p.jsonl", prompt_lines(N, seed=2, max_tokens=14))


@pytest.fixture(scope="module")
def reference(tiny, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.parquet"
    run_generate(config(tiny), prompts, out, progress=False)
    return rows_by_id(out)


@pytest.fixture(scope="module")
def ray_cluster():
    c, ray = start_cluster()
    yield ray
    stop_cluster(c, ray)


def start_job(tiny, prompts, tmp_path):
    """(thread, box, out): the generate job on the three-node fleet, experts sharded, running
    in a thread; box["s"] gets its Summary."""
    fleet = fleet_yaml(tmp_path / "fleet.yaml", slots=(3, 2, 1))
    cfg = config(tiny, workers={"fleet": str(fleet), "experts": "sharded", "num_cpus": 1})
    out = tmp_path / "out.parquet"
    box: dict = {}
    job = threading.Thread(target=lambda: box.update(s=run_generate(cfg, prompts, out, progress=False)))
    job.start()
    return job, box, out


@pytest.mark.slow
def test_killed_worker_loses_no_request(tiny, prompts, reference, ray_cluster, tmp_path, caplog):
    ray = ray_cluster
    caplog.set_level(logging.INFO)
    job, box, out = start_job(tiny, prompts, tmp_path)
    parts = tmp_path / "out.parquet.parts"
    victim = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and job.is_alive():
        if parts.exists() and len(list(parts.glob("part-*.parquet"))) >= 2:  # mid-job
            victim = next(n for n in ray.util.list_named_actors()  # this job's namespace
                          if n.endswith(VICTIM.replace("/", ".")))
            ray.kill(ray.get_actor(victim))
            break
        time.sleep(0.01)
    job.join(timeout=180)
    assert victim is not None and not job.is_alive()
    s = box["s"]
    ids = pq.read_table(out).column("id").to_pylist()
    assert sorted(ids) == sorted(reference)  # every id exactly once
    rows = rows_by_id(out)
    assert all(r["error"] is None for r in rows.values())
    for k, r in reference.items():
        assert rows[k]["completion_tokens"] == r["completion_tokens"], k
    assert s.stats.worker_deaths == 1 and s.stats.recoveries == 1 and s.stats.requeued >= 1
    assert [w["name"] for w in s.workers] == ["cuda-a/cuda0", "mac/metal0"]  # the survivors
    assert sum(w["expert_pins"] for w in s.workers) == 16  # they hold every expert again
    assert not any(r["worker"] == VICTIM for r in rows.values() if r["id"] in requeued_ids(caplog))
    text = caplog.text
    assert f"worker {VICTIM} died" in text and "re-queueing its" in text
    moved = [r for r in caplog.records if "of their routed experts moved to" in r.getMessage()]
    assert len(moved) == 1 and moved[0].args[1] > 0  # it held experts; they moved


@pytest.mark.slow
def test_worker_that_dies_while_starting(tiny, prompts, reference, ray_cluster, tmp_path, caplog):
    """A worker whose model load fails (its actor dies before the first step): the others
    take its experts at once and serve everything, and the job's stats count the death and
    the recovery, once (its metrics counted it, the stats did not: the soak took the kill for
    one of an idle worker, never found)."""
    from dataclasses import replace
    from cluster.ep_group import ShardedGroup
    from cluster.placement import fleet_placements
    from cluster.jobs.generate import _eos, _prepare
    from cluster.requests import read_requests
    from cluster.scheduler import Scheduler
    from workers.config import ModelConfig
    from workers.tokenizer import Tokenizer
    cfg = config(tiny, workers={"fleet": str(fleet_yaml(tmp_path / "f.yaml")), "experts": "sharded"})
    pl = fleet_placements(cfg)
    pl[1] = replace(pl[1], spec=replace(pl[1].spec, model=str(tmp_path / "no-such-model")))
    caplog.set_level(logging.INFO)
    group = ShardedGroup(cfg, pl)
    try:
        assert group.info[1] is None and group.dead == {1} and group.capacities[1] == 0
        assert "worker cuda-b/cuda0 died while starting" in caplog.text
        tok, mcfg = Tokenizer.from_dir(tiny), ModelConfig.from_file(tiny / "config.json")
        items = [_prepare(r, cfg, tok, mcfg.vocab_size) for r in read_requests(prompts)][:8]
        got = []
        stats = Scheduler(group, max_context=cfg.max_context, prefill_chunk=cfg.prefill_chunk,
                          eos_ids=_eos(tok, mcfg), decode=tok.decode, tier=cfg.kv,
                          metrics=group.metrics).run(items, got.append)
        assert (stats.worker_deaths, stats.recoveries, stats.requeued) == (1, 1, 0)
        assert group.metrics.local["worker_deaths"] == 1  # once, not by the group and again
        assert len(got) == 8 and {r.worker for r in got} == {"cuda-a/cuda0", "mac/metal0"}
        for r in got:
            assert r.error is None and r.completion_tokens == reference[r.id]["completion_tokens"]
        assert sum(s["expert_pins"] for s in group.worker_stats()) == 16
    finally:
        group.close()


@pytest.mark.slow
def test_a_worker_killed_while_loading_counts_in_the_jobs_stats(tiny, prompts, reference,
                                                                 ray_cluster, tmp_path, caplog):
    """ray.kill of a worker while the job is still loading the model (as the soak's injector
    kills one): the job recovers (its experts move, every id comes out once with the single
    worker's completions) and its stats, what --stats writes and the soak reads, count the
    death and the recovery (they counted none: the soak called the kill "unseen")."""
    ray = ray_cluster
    caplog.set_level(logging.INFO)
    job, box, out = start_job(tiny, prompts, tmp_path)
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and job.is_alive():
        victim = next((n for n in ray.util.list_named_actors()  # as soon as it is created
                       if n.endswith(VICTIM.replace("/", "."))), None)
        if victim is None:
            time.sleep(0.01)
    assert victim is not None
    ray.kill(ray.get_actor(victim))
    job.join(timeout=180)
    assert not job.is_alive()
    assert f"worker {VICTIM} died while starting" in caplog.text  # the kill landed in the load
    s = box["s"]
    assert (s.stats.worker_deaths, s.stats.recoveries, s.stats.requeued) == (1, 1, 0)
    rows = rows_by_id(out)
    assert sorted(pq.read_table(out).column("id").to_pylist()) == sorted(reference)
    for k, r in reference.items():
        assert rows[k]["error"] is None and rows[k]["completion_tokens"] == r["completion_tokens"], k
    assert {r["worker"] for r in rows.values()} <= {"cuda-a/cuda0", "mac/metal0"}
    assert sum(w["expert_pins"] for w in s.workers) == 16  # the survivors hold every expert


def requeued_ids(caplog) -> set[str]:
    out: set[str] = set()
    for r in caplog.records:
        if "re-queueing its" in r.getMessage():
            out.update(r.args[-1])
    return out


class FlakyTransport:
    """In-process transport whose next call into `layer` raises once armed (a peer that
    vanished half way through a step, after the earlier layers wrote their KV rows)."""

    def __init__(self, peers, layer: int):
        from workers.transport import LocalTransport
        self.inner, self.layer, self.armed = LocalTransport(peers), layer, False
        self.peers = self.inner.peers

    def submit(self, peer, layer, x, idx, w):
        if self.armed and layer == self.layer:
            self.armed = False
            raise ConnectionError(f"peer {peer} vanished in layer {layer}")
        return self.inner.submit(peer, layer, x, idx, w)

    def gather(self, handles):
        return self.inner.gather(handles)


def batch(keys, tokens, positions, sample_at):
    import numpy as np
    from workers.actor import StepBatch
    m = len(sample_at)
    return StepBatch(keys=np.asarray(keys, np.int64), tokens=np.asarray(tokens, np.int32),
                     positions=np.asarray(positions, np.int32),
                     sample_at=np.asarray(sample_at, np.int32), temperature=np.zeros(m, np.float32),
                     top_p=np.ones(m, np.float32), seed=np.zeros(m, np.uint64),
                     counter=np.zeros(m, np.uint64))


def test_step_rerun_after_a_part_way_failure_is_exact(tiny):
    """A survivor's step that failed in its last MoE layer (KV of the earlier layers already
    written, a new slot already mapped) and is then re-run gives the clean run's tokens and
    the clean run's KV rows, and decoding goes on identically."""
    import numpy as np
    from workers.actor import WorkerSpec
    from workers.config import ModelConfig
    from workers.ep_worker import ShardedWorker
    cfg = ModelConfig.from_file(tiny / "config.json")
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    owners = {l: np.arange(cfg.n_routed_experts, dtype=np.int32) % 2 for l in moe}

    def pair():
        ws = [ShardedWorker(WorkerSpec(f"w{r}", str(tiny), "f32", 3, 64), "cpu", r, owners) for r in range(2)]
        for w in ws:
            w.connect(dict(enumerate(ws)), transport="local")
        return ws
    rng = np.random.default_rng(7)
    b_hist = rng.integers(2, cfg.vocab_size, 12)
    a_prompt = rng.integers(2, cfg.vocab_size, 9)
    step1 = batch([5] * 12, b_hist, np.arange(12), [11])
    step2 = batch([9] * 9 + [5], np.concatenate([a_prompt, [3]]), np.r_[np.arange(9), 12], [8, 9])
    step3 = batch([9, 5], [4, 6], [9, 13], [0, 1])
    clean, flaky = pair(), pair()
    flaky[0].experts.transport = t = FlakyTransport(flaky[0].experts.transport.peers, moe[-1])
    want = [clean[0].step(s).next_tokens for s in (step1, step2, step3)]
    assert flaky[0].step(step1).next_tokens.tolist() == want[0].tolist()
    t.armed = True
    with pytest.raises(ConnectionError):
        flaky[0].step(step2)
    assert flaky[0].pool.length(flaky[0]._slot[9]) == 9  # layers before the failure wrote A's rows
    assert flaky[0].step(step2).next_tokens.tolist() == want[1].tolist()  # the re-run
    assert flaky[0].step(step3).next_tokens.tolist() == want[2].tolist()
    for key in (5, 9):
        for layer in range(cfg.num_hidden_layers):
            got = flaky[0].pool.read_rows(flaky[0]._slot[key], layer)
            ref = clean[0].pool.read_rows(clean[0]._slot[key], layer)
            for g, r in zip(got, ref):
                np.testing.assert_array_equal(g, r)
