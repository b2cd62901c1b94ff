"""A cuda worker's routed-expert shard on the GPU (workers/expert_shard.py over CuPy: stacks
uploaded once, workers.moe.grouped_expert_sum on the device) against the host shard (numpy,
which equals workers.moe.expert_sum bit for bit: tests/workers/test_expert_shard.py), and
the SplitShard of a cuda worker whose plan pins only some experts (the rest in host memory,
computed with numpy) against all of them on the device.

Tolerance: every op is float32 (cuBLAS f32 GEMMs, no TF32; the fused SiLU-gate kernel), so
only the order of GEMM sums and the last bits of tanh differ from numpy: each finite output
row must be within RTOL of its largest |value| (the rows' scales differ by 1e7 on purpose),
NaN in the same places, a token with no pick exactly zero. Peer calls from several Python
threads at once must give the answers of one call at a time (a race would be O(1) off)."""
from __future__ import annotations

import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
from kernels.cuda._build import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from expert_data import activations, hostile_routing, stacks  # noqa: E402
from workers.expert_shard import ExpertShard, ShardedExperts, SplitShard  # noqa: E402
from workers.moe import expert_sum  # noqa: E402
from workers.transport import LocalTransport  # noqa: E402

RTOL = 1e-5
LAYER = 3


def assert_close(got, ref, rtol=RTOL):
    """got, ref host [N, hidden]: NaN in the same places; each row's finite values within
    rtol of that row's largest |ref|; a row of zeros in ref exactly zero in got."""
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    for n, (g, r) in enumerate(zip(got, ref)):
        fin = ~np.isnan(r)
        scale = np.abs(r[fin]).max() if fin.any() else 0.0
        err = np.abs(g[fin] - r[fin]).max() if fin.any() else 0.0
        assert err <= rtol * scale, f"row {n}: max |gpu - cpu| {err:.3g} > {rtol} x {scale:.3g}"


def pair(rng, E=12, H=64, I=40, held=9):
    """(host shard, device shard, (gate, up, down) of all E, held ids): the same experts,
    held in a shuffled order."""
    gate, up, down = stacks(rng, E, H, I)
    ids = rng.permutation(E)[:held]
    host, dev = ExpertShard(E), ExpertShard(E, cp)
    pool = cp.get_default_memory_pool()
    for s in (host, dev):
        before = pool.used_bytes()
        s.put(LAYER, ids, gate[ids], up[ids], down[ids])
        if s is dev:  # the stacks are device memory (the uploads' temporaries freed again)
            assert pool.used_bytes() - before >= dev.nbytes()
    return host, dev, (gate, up, down), ids


def routing_over(rng, ids, N, E, k):
    """hostile_routing restricted to the experts `ids` (picks of the others set to -1), with
    two picks for token 2 (the NaN row of `activations`) so that its NaN is computed."""
    idx, w = hostile_routing(rng, N, E, k)
    idx = np.where(np.isin(idx, ids), idx, -1)
    if N > 2:
        idx[2] = -1
        idx[2, [k - 1, 0]] = ids[:2]
    return idx, w


@pytest.mark.parametrize("seed", range(4))
def test_device_shard_equals_the_host_shard(seed):
    rng = np.random.default_rng(seed)
    E, N, k = 12, 29 + seed, 4
    host, dev, _, ids = pair(rng, E)
    x = activations(rng, N, 64)
    idx, w = routing_over(rng, ids, N, E, k)
    lone = ids[-1]  # an expert with one token, which has no other pick
    idx[idx == lone] = -1
    idx[N - 1] = -1
    idx[N - 1, seed % k] = lone
    ref = host.compute(LAYER, x, idx, w)
    got = dev.compute(LAYER, cp.asarray(x), idx, w)
    assert isinstance(got, cp.ndarray) and got.device.id == cp.cuda.Device().id
    got = got.get()
    assert_close(got, ref)
    assert not got[1].any()  # (hostile_routing: token 1 has no pick)
    assert np.isnan(got[2]).all()  # (token 2's NaN row, with picks, reached the output)
    # what the counters read: same count and bytes as the host shard, on "cuda"
    assert (dev.count(), dev.nbytes(), dev.device) == (host.count(), host.nbytes(), "cuda")
    assert dev.ids(LAYER).tolist() == ids.tolist()
    missing = int(np.setdiff1d(np.arange(E), ids)[0])
    with pytest.raises(KeyError, match=rf"experts \[{missing}\] are not held"):
        dev.compute(LAYER, cp.asarray(x), np.where(np.arange(k) == 1, missing, idx), w)
    none = dev.compute(LAYER + 1, cp.asarray(x), np.full_like(idx, -1), w)  # a layer not held
    assert isinstance(none, cp.ndarray) and not none.get().any()


def test_batched_gated_mlp_equals_one_gemm_per_expert():
    """cuda_model.batched_gated_mlp (cublasSgemmBatched over pointer arrays into the stacks)
    against cuda_model.gated_mlp expert by expert: shuffled, repeated and last stack rows,
    rows of very different sizes, a NaN row that stays in its own row, zero padding rows
    exactly zero; and the stacks are not copied (the pool grows by the outputs only)."""
    from workers import cuda_model
    rng = np.random.default_rng(31)
    E, H, I, G, C = 9, 64, 40, 6, 5
    gate, up, down = stacks(rng, E, H, I)
    gu = cp.asarray(np.concatenate([gate, up], axis=1))
    dn = cp.asarray(down)
    rows = np.array([8, 3, 0, 3, 5, 1])  # (a row twice, the last row)
    xs = activations(rng, G * C, H).reshape(G, C, H)
    xs[:, -1] = 0.0  # padding rows
    xd = cp.asarray(xs)
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    got = cuda_model.batched_gated_mlp(rows, xd, gu, dn)
    cp.cuda.Device().synchronize()
    assert pool.used_bytes() - before < 4 * G * C * (H + 2 * I) + 4096  # (no stack copy)
    got = got.get()
    assert got.shape == (G, C, H) and got.dtype == np.float32
    for g, e in enumerate(rows):
        ref = cuda_model.gated_mlp(xd[g], gu[e], dn[e]).get()
        assert_close(got[g], ref)
        assert not got[g, -1].any()
    nan_g, nan_c = divmod(2, C)  # (activations: token 2 has a NaN)
    assert np.isnan(got[nan_g, nan_c]).all()
    assert np.isfinite(np.delete(got.reshape(G * C, H), 2, axis=0)).all()
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda_model.batched_gated_mlp(rows, xd[:, ::2], gu, dn)


def test_add_of_gained_experts_on_the_device():
    """Experts gained after a peer's death come as host arrays (read_experts): the device
    shard uploads and appends them, and computes them as the host shard does."""
    rng = np.random.default_rng(21)
    E, N, k = 12, 33, 3
    host, dev, (gate, up, down), ids = pair(rng, E, held=5)
    gained = np.setdiff1d(np.arange(E), ids)[::-1][:4]
    pool = cp.get_default_memory_pool()
    bytes_before = dev.nbytes()
    for s in (host, dev):
        s.add(LAYER, gained, gate[gained], up[gained], down[gained])
    assert dev.nbytes() == host.nbytes() == bytes_before * 9 // 5
    assert dev.ids(LAYER).tolist() == host.ids(LAYER).tolist() == ids.tolist() + gained.tolist()
    assert pool.used_bytes() >= dev.nbytes()
    x = activations(rng, N, 64)
    both = np.concatenate([ids, gained])
    idx, w = routing_over(rng, both, N, E, k)
    idx[0, :2] = gained[:2]  # surely some gained picks
    assert_close(dev.compute(LAYER, cp.asarray(x), idx, w).get(), host.compute(LAYER, x, idx, w))
    # a layer first met through add (a worker that held none of it)
    for s in (host, dev):
        s.add(LAYER + 2, gained, gate[gained], up[gained], down[gained])
    idx2 = np.where(np.isin(idx, gained), idx, -1)
    assert_close(dev.compute(LAYER + 2, cp.asarray(x), idx2, w).get(),
                 host.compute(LAYER + 2, x, idx2, w))


@pytest.mark.parametrize("split", [False, True])
def test_serve_from_many_threads_at_once_equals_one_at_a_time(split):
    """Peer calls run on the experts concurrency group's threads (16 on a Ray actor): host
    arrays in, upload, compute on the shard's device, download. Many at once must give
    each call's answer as alone, and count every pick served once; also with some of the
    experts in a SplitShard's host part (host_picks counts those)."""
    rng = np.random.default_rng(5)
    E, k = 12, 4
    host, dev, stk, ids = pair(rng, E)
    if split:
        dev, pinned = split_of(stk, ids, rng)
    owners = {LAYER: np.zeros(E, np.int32)}
    ex = ShardedExperts(0, owners, dev)
    calls = []
    for n in (1, 3, 17, 40, 64, 7, 29, 2):
        x = activations(rng, max(n, 3), 64)[:n]
        idx, w = routing_over(rng, ids, max(n, 3), E, k)
        calls.append((x, idx[:n], w[:n]))
    alone = [ex.serve(LAYER, *c) for c in calls]  # (also compiles the kernels once)
    served = ex.counters()["served_picks"]
    threads, rounds = 8, 5
    got = [[None] * len(calls) for _ in range(threads)]
    errors = []
    start = threading.Barrier(threads)

    def run(t):
        try:
            start.wait()
            for r in range(rounds):
                for j in range(len(calls)):
                    c = (j + t + r) % len(calls)  # every thread in another order
                    y = ex.serve(LAYER, *calls[c])
                    if r == rounds - 1:
                        got[t][c] = y
                    else:
                        assert_close(y, alone[c])
        except Exception as e:  # (re-raised below, in the test's thread)
            errors.append((t, e))
    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in pool), "a serve thread hung"
    assert not errors, errors
    for t in range(threads):
        for c in range(len(calls)):
            assert_close(got[t][c], alone[c])
    per_round = sum(int((c[1] >= 0).sum()) for c in calls)
    assert ex.counters()["served_picks"] - served == threads * rounds * per_round
    if split:  # (the answers also equal the all-host shard's)
        for c in range(len(calls)):
            assert_close(alone[c], host.compute(LAYER, *calls[c]))
        on_host = sum(int(np.isin(c[1], ids[~pinned]).sum()) for c in calls)
        assert ex.counters()["host_picks"] == (threads * rounds + 1) * on_host > 0


@pytest.mark.skipif(cp.cuda.runtime.getDeviceCount() < 2, reason="needs two GPUs")
def test_serve_from_a_thread_whose_current_device_is_another():
    """A shard made on GPU 1, served from a fresh thread (whose current device is 0)."""
    rng = np.random.default_rng(9)
    E = 12
    gate, up, down = stacks(rng, E, 64, 40)
    ids = rng.permutation(E)[:8]
    with cp.cuda.Device(1):
        dev = ExpertShard(E, cp)
        dev.put(LAYER, ids, gate[ids], up[ids], down[ids])
    host = ExpertShard(E)
    host.put(LAYER, ids, gate[ids], up[ids], down[ids])
    x = activations(rng, 21, 64)
    idx, w = routing_over(rng, ids, 21, E, 4)
    ex = ShardedExperts(0, {LAYER: np.zeros(E, np.int32)}, dev)
    out = {}
    th = threading.Thread(target=lambda: out.update(y=ex.serve(LAYER, x, idx, w),
                                                    current=cp.cuda.Device().id))
    th.start()
    th.join(timeout=120)
    assert out["current"] == 0  # the thread's own device is left as it was
    assert_close(out["y"], host.compute(LAYER, x, idx, w))


def test_apply_with_device_activations_and_a_host_peer():
    """Rank 0 (device shard) and rank 1 (host shard) split the experts: apply on rank 0
    takes device rows and returns device rows, rank 1's apply is served by rank 0's device
    shard; both give the full expert_sum within RTOL; counters say where each shard lives."""
    rng = np.random.default_rng(13)
    E, H, I, N, k = 12, 64, 40, 37, 4
    gate, up, down = stacks(rng, E, H, I)
    owner = rng.permutation(np.arange(E) % 2).astype(np.int32)
    shards = [ExpertShard(E, cp), ExpertShard(E)]
    ranks = []
    for r, s in enumerate(shards):
        mine = rng.permutation(np.flatnonzero(owner == r))
        s.put(LAYER, mine, gate[mine], up[mine], down[mine])
        ranks.append(ShardedExperts(r, {LAYER: owner}, s))
    for r, ex in enumerate(ranks):
        ex.transport = LocalTransport({1 - r: types.SimpleNamespace(run_experts=ranks[1 - r].serve)})
    x = activations(rng, N, H)
    _, w = hostile_routing(rng, N, E, k)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(N)])  # a router's: k picks each
    idx[0] = np.flatnonzero(owner == 1)[:k]  # all remote for rank 0
    idx[3] = np.flatnonzero(owner == 0)[:k]  # all local for rank 0
    full = expert_sum(x, idx, w, gate, up, down)
    on_dev = ranks[0].apply(LAYER, cp.asarray(x), idx, w)
    assert isinstance(on_dev, cp.ndarray)
    assert_close(on_dev.get(), full)
    assert_close(ranks[1].apply(LAYER, x, idx, w), full)
    c = [ex.counters() for ex in ranks]
    assert [s["expert_device"] for s in c] == ["cuda", "host"]
    assert [s["expert_bytes"] for s in c] == [int((owner == r).sum()) * 3 * H * I * 4 for r in range(2)]
    assert c[0]["served_picks"] == c[1]["remote_picks"] > 0
    assert c[1]["served_picks"] == c[0]["remote_picks"] > 0


def test_cuda_sharded_worker_in_process_gives_the_full_models_logits(tmp_path):
    """A cuda ShardedWorker (CuPy model, experts handed to its device shard) and a cpu one
    over LocalTransport: logits of a ragged prefill + decode mix equal the full numpy
    model's within the CUDA model's f32 tolerance (tests/gpu/test_cuda_model.py); no routed
    expert stack is left in the CudaModel's layers, its shard is on "cuda"."""
    from kvstore.pool import KVPool
    from scripts.make_tiny_model import make_tiny_model
    from workers.actor import WorkerSpec
    from workers.config import ModelConfig
    from workers.ep_worker import ShardedWorker
    from workers.model import Model
    tiny = make_tiny_model(tmp_path / "tiny", 0, ())
    cfg = ModelConfig.from_file(tiny / "config.json")
    E = cfg.n_routed_experts
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    rng = np.random.default_rng(4)
    assert len(moe) >= 2, moe
    owners = {l: rng.permutation(np.arange(E) % 2).astype(np.int32) for l in moe}
    owners[moe[-1]] = np.ones(E, np.int32)  # the cuda worker holds nothing of the last layer
    ws = [ShardedWorker(WorkerSpec(f"w{r}", str(tiny), "f32", 3, 64), kind, r, owners)
          for r, kind in enumerate(("cuda", "cpu"))]
    for w in ws:
        w.connect(dict(enumerate(ws)), transport="local")
    gpu = ws[0]
    assert type(gpu.model).__name__ == "CudaModel" and gpu.experts.device == "cuda"
    assert not any(k.startswith("experts.") for layer in gpu.model.layers for k in layer.d)
    full = Model.load(tiny)
    ref_pool = KVPool.for_model(cfg, "f32", 3, 64)
    slots_ref = [ref_pool.alloc_slot() for _ in range(3)]
    slots_w = [gpu.pool.alloc_slot() for _ in range(3)]
    hist = rng.integers(0, cfg.vocab_size, (3, 12))
    pos = np.tile(np.arange(12), 2)
    full.forward(hist[:2].reshape(-1), np.repeat(slots_ref[:2], 12), pos, ref_pool)
    gpu.model.forward(hist[:2].reshape(-1), np.repeat(slots_w[:2], 12), pos, gpu.pool)
    toks = np.concatenate([rng.integers(0, cfg.vocab_size, 9), [5, 7]])
    pos = np.concatenate([np.arange(9), [12, 12]])
    ref = full.forward(toks, np.array([slots_ref[2]] * 9 + slots_ref[:2]), pos, ref_pool)
    got = gpu.model.forward(toks, np.array([slots_w[2]] * 9 + slots_w[:2]), pos, gpu.pool)
    err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() < 3e-3, f"logits rel err {err.max():.3g}"
    s = [w.stats() for w in ws]
    assert [x["expert_device"] for x in s] == ["cuda", "host"]
    assert gpu.info()["expert_device"] == "cuda"
    per = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    assert s[0]["expert_bytes"] == s[0]["expert_pins"] * per > 0
    assert s[0]["expert_pins"] == sum(int((o == 0).sum()) for o in owners.values())
    assert s[1]["served_picks"] == s[0]["remote_picks"] > 0


def split_of(stk, ids, rng):
    """(SplitShard over `ids`: about half of them, shuffled, pinned in a cupy device part,
    the rest in its numpy host part; the pinned flag of each id)."""
    gate, up, down = stk
    E = gate.shape[0]
    pinned = rng.random(len(ids)) < 0.5
    pinned[:2] = [True, False]
    s = SplitShard(ExpertShard(E, cp), ExpertShard(E))
    s.add(LAYER, ids, gate[ids], up[ids], down[ids], pinned=pinned)
    return s, pinned


@pytest.mark.parametrize("seed", range(3))
def test_split_shard_equals_all_on_the_device(seed):
    """Some experts pinned on the GPU, the others in host memory: device activations in,
    the host picks' rows down, numpy, up and added: the all-on-device shard's output within
    RTOL (hostile routing: -1 picks, a token with none, a NaN row that picks nothing, a NaN
    row with host picks only, a token all on host). The device holds only the pinned
    stacks: nbytes of the device part, and the memory pool grew by no host expert."""
    rng = np.random.default_rng(60 + seed)
    E, H, I, N, k = 12, 64, 40, 35 + seed, 4
    host, dev, stk, ids = pair(rng, E, H, I, held=10)
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    split, pinned = split_of(stk, ids, rng)
    per = 3 * H * I * 4
    grew = pool.used_bytes() - before
    assert split.dev.nbytes() == int(pinned.sum()) * per and split.host.nbytes() == int((~pinned).sum()) * per
    assert split.dev.nbytes() <= grew < split.dev.nbytes() + per, (grew, split.dev.nbytes())
    assert split.host.xp is np and isinstance(split.host._layers[LAYER][2][0], np.ndarray)
    x = activations(rng, N, H)
    idx, w = routing_over(rng, ids, N, E, k)
    host_ids = ids[~pinned]
    idx[0] = -1
    idx[0, :min(k, len(host_ids))] = host_ids[:k]
    idx[4] = -1
    idx[4, 2] = host_ids[0]
    x[1] = np.nan  # (token 1 picks nothing)
    x[4] = np.nan
    ref = dev.compute(LAYER, cp.asarray(x), idx, w).get()
    got = split.compute(LAYER, cp.asarray(x), idx, w)
    assert isinstance(got, cp.ndarray)
    got = got.get()
    assert_close(got, ref)
    assert not got[1].any() and np.isnan(got[4]).all()
    assert split.host_picks(LAYER, idx) == int(np.isin(idx, host_ids).sum()) > 0
    ex = ShardedExperts(0, {LAYER: np.zeros(E, np.int32)}, split)
    assert_close(ex.apply(LAYER, cp.asarray(x), idx, w).get(), ref)
    c = ex.counters()
    assert (c["expert_pins_device"], c["expert_pins_host"]) == (int(pinned.sum()), int((~pinned).sum()))
    assert c["expert_bytes_device"] == split.dev.nbytes() and c["expert_device"] == "cuda"
    assert c["host_picks"] == split.host_picks(LAYER, idx)


def test_cuda_worker_keeps_unpinned_experts_in_host_memory(tmp_path):
    """A cuda ShardedWorker whose pinned table pins only some of its experts (and none of
    one layer): the CudaModel loads only those (its shard's device part holds exactly
    them; no expert stack left in its layers), the others are in the host part; logits of a
    ragged batch equal the full numpy model's, host_picks > 0; a gained expert that the
    group does not pin goes to host memory, a pinned one to the device."""
    from kvstore.pool import KVPool
    from scripts.make_tiny_model import make_tiny_model
    from workers.actor import WorkerSpec
    from workers.config import ModelConfig
    from workers.ep_worker import ShardedWorker
    from workers.model import Model
    tiny = make_tiny_model(tmp_path / "tiny", 0, ())
    cfg = ModelConfig.from_file(tiny / "config.json")
    E = cfg.n_routed_experts
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    rng = np.random.default_rng(6)
    owners = {l: rng.permutation(np.arange(E) % 2).astype(np.int32) for l in moe}
    pinned = {l: (owners[l] == 0) & (rng.random(E) < 0.5) for l in moe}
    pinned[moe[-1]][:] = False  # nothing of the last layer on the GPU
    ws = [ShardedWorker(WorkerSpec(f"w{r}", str(tiny), "f32", 3, 64), kind, r, owners,
                        pinned if r == 0 else None)
          for r, kind in enumerate(("cuda", "cpu"))]
    for w in ws:
        w.connect(dict(enumerate(ws)), transport="local")
    gpu = ws[0]
    sh = gpu.experts.shard
    assert isinstance(sh, SplitShard) and gpu.experts.device == "cuda"
    assert not any(k.startswith("experts.") for layer in gpu.model.layers for k in layer.d)
    for l in moe:
        assert sorted(sh.dev.ids(l).tolist()) == np.flatnonzero(pinned[l]).tolist()
        assert sorted(sh.host.ids(l).tolist()) == np.flatnonzero((owners[l] == 0) & ~pinned[l]).tolist()
    per = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    n_pin = sum(int(p.sum()) for p in pinned.values())
    c = gpu.stats()
    assert c["expert_bytes_device"] == sh.dev.nbytes() == n_pin * per > 0
    assert c["expert_pins_host"] == c["expert_pins"] - n_pin > 0
    full = Model.load(tiny)
    ref_pool = KVPool.for_model(cfg, "f32", 3, 64)
    sr, sw = ref_pool.alloc_slot(), gpu.pool.alloc_slot()
    toks = rng.integers(0, cfg.vocab_size, 13)
    ref = full.forward(toks, np.full(13, sr), np.arange(13), ref_pool)
    got = gpu.model.forward(toks, np.full(13, sw), np.arange(13), gpu.pool)
    err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() < 3e-3, f"logits rel err {err.max():.3g}"
    assert gpu.stats()["host_picks"] > 0
    # rank 1 dies: rank 0 gains its experts, pinned as the group says
    gained = {l: np.flatnonzero(owners[l] == 1) for l in moe}
    new_pin = {l: pinned[l].copy() for l in moe}
    for l in moe:
        new_pin[l][gained[l][::2]] = True
    gpu.reassign({l: np.zeros(E, np.int32) for l in moe}, (1,), new_pin)
    for l in moe:
        assert sorted(sh.dev.ids(l).tolist()) == np.flatnonzero(new_pin[l]).tolist()
        assert sorted(sh.host.ids(l).tolist()) == np.flatnonzero(~new_pin[l]).tolist()
    got = gpu.model.forward(toks, np.full(13, gpu.pool.alloc_slot()), np.arange(13), gpu.pool)
    err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() < 3e-3, f"logits rel err after reassign {err.max():.3g}"
