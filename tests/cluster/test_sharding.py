"""Expert parallelism: the shard loader reads only its experts; sharded workers give the
full model's logits (numpy and MLX workers, a worker with no experts of a layer); the
generate job sharded in-process and on a three-node Ray cluster gives the single worker's
greedy completions, every routed expert has one owner, slots go by capacity."""
from __future__ import annotations

import numpy as np
import pytest

from cluster.jobs.generate import run_generate
from cluster.requests import read_requests
from cluster.scheduler import Scheduler
from fleet_cluster import HAS_MLX, fleet_yaml, start_cluster, stop_cluster
from kvstore.pool import KVPool
from runtime_helpers import job_config, prompt_lines, rows_by_id, write_lines
from workers.actor import LocalGroup, WorkerSpec
from workers.config import ModelConfig
from workers import ep_worker
from workers.ep_worker import ShardedWorker
from workers.model import Model
from workers.safetensors_io import TensorRef
from workers.weights import load_params, loaded_bytes

N = 14


def config(tiny, **kw):
    return job_config(tiny, **kw)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    prompts = write_lines(d / "p.jsonl", prompt_lines(N))
    run_generate(config(tiny), prompts, d / "out.parquet", progress=False)
    return rows_by_id(d / "out.parquet")


def owner_table(cfg):
    """Uneven and hostile: in layer 1 rank 2 owns nothing; in layer 2 rank 0 owns one."""
    E = cfg.n_routed_experts
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    rng = np.random.default_rng(5)
    t = {moe[0]: rng.permutation(np.arange(E) % 2).astype(np.int32)}
    last = np.full(E, 1, np.int32)
    last[rng.choice(E, 3, replace=False)] = [0, 2, 2]
    t[moe[-1]] = last
    return t


def test_shard_loader_reads_only_its_experts(tiny, monkeypatch):
    cfg = ModelConfig.from_file(tiny / "config.json")
    full = load_params(tiny, cfg)
    read = []
    orig = TensorRef.read
    monkeypatch.setattr(TensorRef, "read", lambda self: (read.append(self.name), orig(self))[1])
    want = {1: np.array([6, 2]), 2: np.array([], np.int64)}
    part = load_params(tiny, cfg, experts=want)
    experts_read = sorted(n for n in read if ".experts." in n)
    assert experts_read == sorted(f"model.layers.1.mlp.experts.{j}.{p}_proj.weight"
                                  for j in (6, 2) for p in ("gate", "up", "down"))
    assert part["layers.1.experts.gate"].shape == (2, *full["layers.1.experts.gate"].shape[1:])
    for name in ("gate", "up", "down"):
        np.testing.assert_array_equal(part[f"layers.1.experts.{name}"], full[f"layers.1.experts.{name}"][[6, 2]])
        assert f"layers.2.experts.{name}" not in part
    for k in full:  # dense weights all there, unchanged
        if ".experts." not in k:
            np.testing.assert_array_equal(part[k], full[k])
    # ids a shard cannot hold are named, not left as np.empty rows of its stacks
    for bad in ({1: np.array([6, 8])}, {1: np.array([2, 2])}, {1: np.array([-1])},
                {0: np.array([1])}, {1: np.array([1.5])}):  # (layer 0 is dense)
        with pytest.raises(ValueError, match=r"experts\[[01]\]"):
            load_params(tiny, cfg, experts=bad)


@pytest.mark.parametrize("kinds", [("cpu", "cpu", "cpu")] + ([("cpu", "metal", "cpu")] if HAS_MLX else []))
def test_sharded_workers_give_the_full_models_logits(tiny, kinds):
    cfg = ModelConfig.from_file(tiny / "config.json")
    owners = owner_table(cfg)
    ws = [ShardedWorker(WorkerSpec(f"w{r}", str(tiny), "f32", 3, 64), k, r, owners)
          for r, k in enumerate(kinds)]
    for w in ws:
        w.connect(dict(enumerate(ws)), transport="local")
    for layer, o in owners.items():  # each worker holds exactly its experts
        for r, w in enumerate(ws):
            assert sorted(w.experts.shard.ids(layer).tolist()) == np.flatnonzero(o == r).tolist()
    full = Model.load(tiny)
    rng = np.random.default_rng(1)
    for r, w in enumerate(ws):  # a ragged mix: a 9-token prefill chunk and two decodes
        ref_pool = KVPool.for_model(cfg, "f32", 3, 64)
        slots_ref = [ref_pool.alloc_slot() for _ in range(3)]
        slots_w = [w.pool.alloc_slot() for _ in range(3)]
        hist = rng.integers(0, cfg.vocab_size, (3, 12))
        run = w.on_model_thread  # MLX arrays live on the thread that made them
        full.forward(hist[:2].reshape(-1), np.repeat(slots_ref[:2], 12), np.tile(np.arange(12), 2), ref_pool)
        run(w.model.forward, hist[:2].reshape(-1), np.repeat(slots_w[:2], 12), np.tile(np.arange(12), 2), w.pool)
        toks = np.concatenate([rng.integers(0, cfg.vocab_size, 9), [5, 7]])
        pos = np.concatenate([np.arange(9), [12, 12]])
        ref = full.forward(toks, np.array([slots_ref[2]] * 9 + slots_ref[:2]), pos, ref_pool)
        got = run(w.model.forward, toks, np.array([slots_w[2]] * 9 + slots_w[:2]), pos, w.pool)
        tol = 2e-4 if w.kind == "metal" else 1e-5
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    stats = [w.stats() for w in ws]
    k = cfg.num_experts_per_tok
    for s in stats:  # 2 * 12 + 11 tokens, k picks in each of the MoE layers
        assert s["local_picks"] + s["remote_picks"] == (24 + 11) * k * len(owners)
        assert s["expert_hit_rate"] == pytest.approx(s["local_picks"] / (24 + 11) / k / len(owners))
    assert sum(s["served_picks"] for s in stats) == sum(s["remote_picks"] for s in stats)
    assert [s["expert_pins"] for s in stats] == [sum(int((o == r).sum()) for o in owners.values())
                                                 for r in range(3)]


def test_cuda_worker_on_the_host_counts_every_step_as_a_fallback(tiny, monkeypatch):
    """A fleet device of kind cuda where CuPy sees no GPU runs the numpy model: said once in
    the log, and counted in each step's fallbacks (kvfleet_fallbacks, path
    cuda.host_model_steps), so a dashboard shows it."""
    from workers import cuda_model
    from workers.actor import StepBatch
    monkeypatch.setattr(cuda_model, "use_cuda", lambda name: False)
    cfg = ModelConfig.from_file(tiny / "config.json")
    owners = {l: np.zeros(cfg.n_routed_experts, np.int32)  # one rank holds every expert
              for l in range(cfg.num_hidden_layers) if cfg.is_moe_layer(l)}
    w = ShardedWorker(WorkerSpec("g/cuda0", str(tiny), "f32", 2, 64), "cuda", 0, owners)
    w.connect({0: w}, transport="local")
    assert w.info()["model"] == "Model"
    one = lambda: np.zeros(1, np.uint64)  # noqa: E731
    for step in range(2):
        out = w.step(StepBatch(keys=np.array([7], np.int64), tokens=np.array([3], np.int32),
                               positions=np.array([step], np.int32),
                               sample_at=np.array([0], np.int32),
                               temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32),
                               seed=one(), counter=one()))
        assert out.fallbacks == {"cuda.host_model_steps": 1}
    cpu = ShardedWorker(WorkerSpec("c", str(tiny), "f32", 2, 64), "cpu", 0, owners)
    assert "cuda.host_model_steps" not in cpu._drain_fallbacks()


def test_inprocess_sharded_job_matches_single_worker(tiny, tmp_path, reference):
    prompts = write_lines(tmp_path / "p.jsonl", prompt_lines(N))
    cfg = config(tiny, slots=2, workers={"runtime": "inprocess", "count": 3, "experts": "sharded"})
    s = run_generate(cfg, prompts, tmp_path / "out.parquet", progress=False)
    rows = rows_by_id(tmp_path / "out.parquet")
    assert s.errors == 0 and len(rows) == N
    assert [w["name"] for w in s.workers] == ["worker0", "worker1", "worker2"]
    assert sum(w["expert_pins"] for w in s.workers) == 16  # 8 experts x 2 MoE layers, once each
    assert all(w["rss_bytes"] > 0 and 0 <= w["expert_hit_rate"] <= 1 for w in s.workers)
    assert {r["worker"] for r in rows.values()} == {"worker0", "worker1", "worker2"}
    for k, r in reference.items():
        assert rows[k]["completion_tokens"] == r["completion_tokens"], k


@pytest.mark.slow
def test_three_node_fleet_sharded_matches_single_worker(tiny, tmp_path, reference):
    from cluster.ep_group import start_group
    from cluster.jobs.generate import _eos, _prepare
    from workers.tokenizer import Tokenizer
    fleet = fleet_yaml(tmp_path / "fleet.yaml", slots=(3, 2, 1))
    cfg = config(tiny, workers={"fleet": str(fleet), "experts": "sharded", "num_cpus": 1})
    c, ray = start_cluster()
    try:
        group, close = start_group(cfg)
        try:
            nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
            for info in group.info:  # each actor on a node offering its kind
                kind = "cuda" if info["name"].startswith("cuda") else "metal"
                assert nodes[info["node_id"]].get(f"kvfleet_{kind}") == 1, info
            assert [i["device"] for i in group.info][:2] == ["cuda", "cuda"]
            tok = Tokenizer.from_dir(tiny)
            mcfg = ModelConfig.from_file(tiny / "config.json")
            items = [_prepare(r, cfg, tok, mcfg.vocab_size)
                     for r in read_requests(write_lines(tmp_path / "p.jsonl", prompt_lines(N)))]
            results = []
            sched = Scheduler(group, max_context=cfg.max_context, prefill_chunk=cfg.prefill_chunk,
                              eos_ids=_eos(tok, mcfg), decode=tok.decode, tier=cfg.kv,
                              metrics=group.metrics)  # (as the generate job does)
            admitted = []
            orig = sched._admit

            def spy(waiting, active):
                before = len(active)
                orig(waiting, active)
                admitted.extend(s.worker for s in active[before:])
            sched._admit = spy
            sched.run(items, results.append)
            # by free share of capacity (3, 2, 1 slots): one each first, then 2nd slots, ...
            assert admitted[:6] == [0, 1, 2, 0, 1, 0]
            got = {r.id: r for r in results}
            assert len(got) == N and all(r.error is None for r in got.values())
            for k, r in reference.items():
                assert got[k].completion_tokens == r["completion_tokens"], k
            stats = group.worker_stats()
            owners = group.owners[0]
            for layer, o in owners.items():  # one owner per routed expert, all held
                assert (o >= 0).all() and (o < 3).all()
            assert sum(s["expert_pins"] for s in stats) == sum(len(o) for o in owners.values())
            # dealt out evenly; the one left over to the most room (1 slot: the least KV)
            assert [s["expert_pins"] for s in stats] == [5, 5, 6]
            assert all(0 < s["expert_hit_rate"] < 1 for s in stats)
            assert sum(s["served_picks"] for s in stats) == sum(s["remote_picks"] for s in stats)
            # one request alone: the two workers without sequences still serve their experts
            one = []
            sched.run([items[3]], one.append)
            assert one[0].completion_tokens == reference[items[3].req.id]["completion_tokens"]
            after = group.worker_stats()
            busy = group.names.index(one[0].worker)
            for i, (a, b) in enumerate(zip(stats, after)):
                if i != busy:
                    assert b["served_picks"] > a["served_picks"] and b["local_picks"] == a["local_picks"]
        finally:
            close()
        for s in stats:  # the gauges, as the scheduler's stats call at its run's end left them
            assert group.metrics.local[f"expert_pins[{s['name']}]"] == s["expert_pins"]
            assert 0 < group.metrics.local[f"expert_hit_rate[{s['name']}]"] < 1
    finally:
        stop_cluster(c, ray)


def test_placements_by_kind_resource_and_admission_by_capacity(tiny, tmp_path):
    """Fleet devices without resources ask for kvfleet_<kind> (cuda adds a GPU only beside
    it); new requests go to the worker with the largest free share of its slots."""
    from cluster.placement import fleet_placements
    from cluster.planner import deal_evenly
    from scheduler_fakes import EOS, FakeModel, FakePool, decode
    from test_scheduler import prep, prompts
    from workers.actor import Worker
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes:\n"
                     "  - {name: g, kind: cuda, devices: 2, memory: 80, slots: 4}\n"
                     "  - {name: h, kind: cpu, memory: 64, slots: 2, resources: {bigmem: 1}, labels: {zone: b}}\n"
                     "  - {name: m, kind: metal, memory: 64, slots: 2}\n")
    pl = fleet_placements(config(tiny, workers={"fleet": str(fleet)}))
    assert [(p.spec.name, p.kind, p.spec.slots) for p in pl] == [
        ("g/cuda0", "cuda", 4), ("g/cuda1", "cuda", 4), ("h/cpu0", "cpu", 2), ("m/metal0", "metal", 2)]
    assert pl[0].options == {"num_cpus": 1.0, "resources": {"kvfleet_cuda": 1.0}, "num_gpus": 1}
    assert pl[2].options == {"num_cpus": 1.0, "resources": {"bigmem": 1.0}, "label_selector": {"zone": "b"}}
    assert pl[3].options == {"num_cpus": 1.0, "resources": {"kvfleet_metal": 1.0}}
    assert all(p.expert_room > 0 for p in pl)
    six = np.array([(1, e) for e in range(6)], np.int32)
    assert deal_evenly([10, 5, 100], 2, six).owner.tolist() == [2, 0, 1] * 2  # 2 x 2 B fits all
    assert deal_evenly([3, 5, 100], 2, six) is None  # it does not: most room first
    assert np.bincount(deal_evenly([4, 5, 100], 2, six[:5]).owner).tolist() == [1, 2, 2]  # 5 = 2 + 2 + 1
    plain = fleet_placements(config(tiny, workers={"count": 2}))
    assert [p.options for p in plain] == [{"num_cpus": 1.0}] * 2  # no fleet: nothing invented
    group = LocalGroup([Worker(WorkerSpec(f"w{i}", "fake", "f32", c, 64), model=FakeModel(),
                               pool=FakePool(c, 64)) for i, c in enumerate((4, 2, 2))])
    sched = Scheduler(group, max_context=64, prefill_chunk=8, eos_ids=[EOS], decode=decode, tier="f32")
    from collections import deque
    waiting, active = deque(prep(i, p) for i, p in enumerate(prompts(4))), []
    sched._admit(waiting, active)
    assert [s.worker for s in active] == [0, 1, 2, 0]  # 2 : 1 : 1 for capacities 4 : 2 : 2


def test_the_plans_pinned_flags_reach_each_worker(tiny, monkeypatch):
    """Uneven rooms (no even share fits: most room first, 6 of 16 experts left unpinned) for
    two cuda workers and a cpu one: split_owners carries the planner's pinned flag of every
    expert to its owner (a cuda worker's room counted in float32 experts, what it uploads), a cuda worker loads only its pinned experts onto the model (the
    device; here load_cuda is watched and builds the numpy model, as no GPU is here) and
    reads the others into host memory, a cpu worker loads all of its own; each holds exactly
    its share and the group's logits are the full model's."""
    from cluster.footprint import Footprint
    from cluster.placement import split_owners
    from cluster.planner import split_experts
    from workers import cuda_model
    cfg = config(tiny, workers={"runtime": "inprocess", "experts": "sharded"})
    mcfg = ModelConfig.from_file(tiny / "config.json")
    fp = Footprint.from_file(tiny / "config.json")
    eb, ef = fp.expert_bytes("bf16"), loaded_bytes(mcfg)[1]
    assert ef == 2 * eb
    rooms, kinds = [5 * ef + ef // 2, 2 * ef, 3 * eb], ("cuda", "cuda", "cpu")
    split = split_owners(cfg, rooms, list(kinds), True)
    assert split.expert_bytes == [ef, ef, eb]
    a = split_experts(fp, rooms, "bf16", expert_bytes=[ef, ef, eb])
    assert not a.even and (~a.pinned).sum() == 6
    assert [sum(int(p.sum()) for p in split.pinned[r].values()) for r in range(3)] == [5, 2, 3]
    for (l, e), o, p in zip(a.experts.tolist(), a.owner.tolist(), a.pinned.tolist()):
        assert split.owners[0][l][e] == o
        assert [bool(split.pinned[r][l][e]) for r in range(3)] == [r == o and p for r in range(3)]
    assert all(s is split.owners[0] for s in split.owners)  # one table for all
    moe = sorted(split.owners[0])
    per_layer = [[int(split.pinned[0][l].sum()) for l in moe], [int(split.pinned[1][l].sum()) for l in moe]]
    assert per_layer[0] != per_layer[1]  # (ragged: the ranks pin different counts per layer)
    loads = []
    real_read = ep_worker.read_experts
    reads = []

    def load_cuda(model_dir, tier, slots, max_ctx, block_size=16, experts=None):
        loads.append({l: sorted(np.asarray(v).tolist()) for l, v in experts.items()})
        return Model(mcfg, load_params(model_dir, mcfg, experts=experts)), None

    def read_experts(model_dir, c, wanted):
        reads.append({l: sorted(np.asarray(v).tolist()) for l, v in wanted.items()})
        return real_read(model_dir, c, wanted)
    monkeypatch.setattr(cuda_model, "use_cuda", lambda name: True)
    monkeypatch.setattr(cuda_model, "load_cuda", load_cuda)
    monkeypatch.setattr(ep_worker, "read_experts", read_experts)
    ws = [ShardedWorker(WorkerSpec(f"w{r}", str(tiny), "f32", 2, 64), k, r, split.owners[r], split.pinned[r])
          for r, k in enumerate(kinds)]
    owned = lambda r, l: np.flatnonzero(split.owners[0][l] == r).tolist()  # noqa: E731
    for r in (0, 1):  # the cuda workers: pinned on the model, the rest read for host memory
        assert loads[r] == {l: np.flatnonzero(split.pinned[r][l]).tolist() for l in moe}
        rest = {l: sorted(set(owned(r, l)) - set(loads[r][l])) for l in moe}
        assert reads[r] == {l: v for l, v in rest.items() if v} and any(rest.values())
    assert len(loads) == 2 and len(reads) == 2  # the cpu worker: its model loads all of its own
    for r, w in enumerate(ws):
        for l in moe:
            assert sorted(w.experts.shard.ids(l).tolist()) == owned(r, l)
    for w in ws:
        w.connect(dict(enumerate(ws)), transport="local")
    full = Model.load(tiny)
    rng = np.random.default_rng(2)
    toks = rng.integers(0, mcfg.vocab_size, 11)
    ref_pool = KVPool.for_model(mcfg, "f32", 1, 64)
    ref = full.forward(toks, np.full(11, ref_pool.alloc_slot()), np.arange(11), ref_pool)
    for w in ws:
        got = w.model.forward(toks, np.full(11, w.pool.alloc_slot()), np.arange(11), w.pool)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_a_pinned_table_that_does_not_fit_the_owners_is_refused(tiny):
    cfg = ModelConfig.from_file(tiny / "config.json")
    owners = owner_table(cfg)
    bad = {l: np.ones(cfg.n_routed_experts - 1, bool) for l in owners}
    with pytest.raises(ValueError, match=r"pinned: needs a bool\[8\] for each MoE layer"):
        ShardedWorker(WorkerSpec("w", str(tiny), "f32", 1, 64), "cpu", 0, owners, bad)
    with pytest.raises(ValueError, match=r"pinned: .*\[1, 2\]"):
        ShardedWorker(WorkerSpec("w", str(tiny), "f32", 1, 64), "cpu", 0, owners,
                      {min(owners): np.ones(8, bool)})


def test_recovery_pins_gained_experts_only_while_the_device_room_lasts():
    """Worker 2 dies owning 6 experts. Cuda worker 0 (room 4.5 experts) owns 5 and pins 3:
    1.5 experts of device room left, so it pins one orphan and serves the rest it gains from
    host memory; cpu worker 1 (room 6, owns 5) counts all it owns against its room. Every
    orphan gets one live owner; the pinned table given to reassign says which fit."""
    from cluster.ep_group import ShardedGroup
    eb, E = 1000, 8
    rng = np.random.default_rng(3)
    layers = (1, 2)
    owners = {l: np.zeros(E, np.int32) for l in layers}
    cells = [(l, e) for l in layers for e in range(E)]
    order = rng.permutation(len(cells))
    who = np.array([0] * 5 + [1] * 5 + [2] * 6)
    for c, r in zip(order, who):
        l, e = cells[c]
        owners[l][e] = r
    pinned = [{l: np.zeros(E, bool) for l in layers} for _ in range(3)]
    for c in order[:3]:  # worker 0 pins 3 of its 5
        pinned[0][cells[c][0]][cells[c][1]] = True
    for c in order[5:10]:
        pinned[1][cells[c][0]][cells[c][1]] = True
    g = ShardedGroup.__new__(ShardedGroup)
    g.actors, g.kinds = [None] * 3, ["cuda", "cpu", "cuda"]
    g.owners, g.pinned, g.expert_bytes = [owners] * 3, pinned, [eb] * 3
    g.room = [4 * eb + eb // 2, 6 * eb, 10 * eb]
    moved = g._move_experts([2], [0, 1])
    new = g.owners[0]
    assert all(t is new for t in g.owners)
    orphans = [cells[c] for c in order[10:]]
    assert sorted(sum(moved.values(), [])) == sorted(orphans)
    assert all(new[l][e] in (0, 1) for l, e in orphans)
    gained0 = [(l, e) for l, e in orphans if new[l][e] == 0]
    assert len(gained0) >= 2  # (so a host one is among them)
    assert sum(bool(g.pinned[0][l][e]) for l, e in gained0) == 1  # one fits the 1.5 left
    assert sum(int(p.sum()) for p in g.pinned[0].values()) * eb <= g.room[0]
    for l, e in orphans:  # a pin only where the owner is
        assert [bool(g.pinned[r][l][e]) for r in (0, 1) if r != new[l][e]] == [False]
    assert sum(int(p.sum()) for p in pinned[0].values()) == 3  # (the old table is not edited)
