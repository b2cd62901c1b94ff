"""The routed-expert sum that every shard runs (workers.moe.grouped_expert_sum: numpy here,
CuPy on a cuda worker's GPU, tests/gpu/test_expert_shard_gpu.py) against the reference
workers.moe.expert_sum bit for bit on hostile routing, and the host ExpertShard /
ShardedExperts around it (data: tests/workers/expert_data.py)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from workers.expert_shard import ExpertShard, ShardedExperts, SplitShard
from expert_data import activations, bits, hostile_routing, stacks
from workers.moe import batched_expert_sum, expert_sum, gated_mlp, grouped_expert_sum
from workers.transport import LocalTransport


@pytest.mark.parametrize("seed", range(6))
def test_grouped_sum_equals_expert_sum_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    E, H, I, N, k = 9, 48 + seed, 24 + 3 * seed, 23, 4
    gate, up, down = stacks(rng, E, H, I)
    x = activations(rng, N, H)
    idx, w = hostile_routing(rng, N, E, k)
    ref = expert_sum(x, idx, w, gate, up, down)
    got = grouped_expert_sum(x, idx, w, lambda e, r: gated_mlp(r, gate[e], up[e], down[e]))
    assert got.dtype == np.float32 and got.shape == (N, H)
    np.testing.assert_array_equal(bits(got), bits(ref))
    assert not got[1].any()  # every pick -1: zeros
    assert np.isnan(got[2]).all() == (idx[2] >= 0).any()
    assert np.isfinite(np.delete(got, 2, axis=0)).all()


def test_grouped_sum_edge_batches():
    """No pick at all, one token, a token picking every expert: still expert_sum's bits."""
    rng = np.random.default_rng(11)
    E, H, I = 5, 16, 8
    gate, up, down = stacks(rng, E, H, I)
    mlp = lambda e, r: gated_mlp(r, gate[e], up[e], down[e])  # noqa: E731
    x = rng.standard_normal((3, H)).astype(np.float32)
    none = np.full((3, 2), -1)
    out = grouped_expert_sum(x, none, np.ones((3, 2), np.float32), mlp)
    np.testing.assert_array_equal(bits(out), bits(np.zeros_like(x)))
    for idx in (np.array([[3, 0]]), np.array([rng.permutation(E)] * 3)):
        n = len(idx)
        w = rng.standard_normal(idx.shape).astype(np.float32)
        np.testing.assert_array_equal(bits(grouped_expert_sum(x[:n], idx, w, mlp)),
                                      bits(expert_sum(x[:n], idx, w, gate, up, down)))


def _row_mlp(gate, up, down):
    """(mlp(e, rows), batched_mlp(es, xs [G, C, H])) that run gated_mlp one row at a time, so
    that a row's result cannot depend on the rows beside it (BLAS may block by row count):
    then the bucketed sum must equal the expert loop's bit for bit, which checks its padding,
    weights and order of additions exactly."""
    def mlp(e, r):
        return np.concatenate([gated_mlp(r[i:i + 1], gate[e], up[e], down[e])
                               for i in range(len(r))]) if len(r) else r
    seen = []

    def batched(es, xs):
        assert xs.ndim == 3 and xs.shape[0] == len(es) and list(es) == sorted(es)
        seen.append(xs.shape[:2])
        return np.stack([mlp(e, x) for e, x in zip(es, xs)])
    return mlp, batched, seen


@pytest.mark.parametrize("seed", range(4))
def test_batched_sum_equals_the_expert_loop(seed):
    """workers.moe.batched_expert_sum (the GPU shards' and CudaLayer's routed experts) against
    grouped_expert_sum on hostile routing whose experts have 1 .. N tokens (many buckets):
    the same bits, every expert of a bucket padded to its largest count with less than half
    padding, a token with no pick zeros, the NaN token's NaN only in its own row."""
    rng = np.random.default_rng(60 + seed)
    E, H, I, N, k = 11, 20 + seed, 12, 37, 5
    gate, up, down = stacks(rng, E, H, I)
    x = activations(rng, N, H)
    idx, w = hostile_routing(rng, N, E, k)
    idx[:, 0] = np.where(np.arange(N) % (seed + 2) == 0, 0, idx[:, 0])  # expert 0: a big bucket
    idx[1] = -1
    for n in range(N):  # (distinct picks per token, as the router makes them)
        row = idx[n][idx[n] >= 0]
        if len(set(row.tolist())) < len(row):
            idx[n, 1:] = -1
    mlp, batched, seen = _row_mlp(gate, up, down)
    ref = grouped_expert_sum(x, idx, w, mlp)
    got = batched_expert_sum(x, idx, w, batched)
    np.testing.assert_array_equal(bits(got), bits(ref))
    assert not got[1].any()
    counts = np.bincount(idx[idx >= 0], minlength=E)
    assert sum(g for g, _ in seen) == (counts > 0).sum() and len(seen) > 2
    assert sum(g * c for g, c in seen) < 2 * counts.sum()


def test_batched_sum_edge_batches():
    """No pick at all, one token with one pick, every token picking every expert (one bucket),
    and one expert picked by every token beside experts picked once."""
    rng = np.random.default_rng(12)
    E, H, I = 6, 16, 8
    gate, up, down = stacks(rng, E, H, I)
    mlp, batched, _ = _row_mlp(gate, up, down)
    x = activations(rng, 9, H)
    none = np.full((9, 2), -1)
    assert not batched_expert_sum(x, none, np.ones((9, 2), np.float32), batched).any()
    for idx in (np.array([[4]]), np.array([rng.permutation(E)] * 9),
                np.stack([[0, 1 + n % (E - 1)] for n in range(9)])):
        n = len(idx)
        w = rng.standard_normal(idx.shape).astype(np.float32)
        np.testing.assert_array_equal(bits(batched_expert_sum(x[:n], idx, w, batched)),
                                      bits(grouped_expert_sum(x[:n], idx, w, mlp)))


def test_host_shard_computes_its_rows_with_shuffled_ids_and_gained_experts():
    """A shard holding experts in a shuffled order (and more added later, as reassign does)
    gives expert_sum over its own rows bit for bit, and expert_sum over the full stacks
    within float32 rounding; experts it does not hold are named."""
    rng = np.random.default_rng(3)
    E, H, I, N, k = 12, 32, 16, 19, 3
    gate, up, down = stacks(rng, E, H, I)
    held = rng.permutation(E)[:7]
    gained = np.setdiff1d(np.arange(E), held)[::-1][:3]
    shard = ExpertShard(E)
    shard.put(4, held, gate[held], up[held], down[held])
    shard.add(4, gained, gate[gained], up[gained], down[gained])
    ids = np.concatenate([held, gained])
    assert shard.ids(4).tolist() == ids.tolist() and shard.count() == 10
    assert shard.nbytes() == 10 * 4 * (3 * H * I) and shard.device == "host"
    x = activations(rng, N, H)
    idx, w = hostile_routing(rng, N, E, k)
    idx = np.where(np.isin(idx, ids), idx, -1)
    idx[0, 0] = gained[0]
    got = shard.compute(4, x, idx, w)
    rows = np.where(idx >= 0, np.argsort(ids)[np.searchsorted(ids[np.argsort(ids)], idx)], -1)
    np.testing.assert_array_equal(bits(got), bits(expert_sum(x, rows, w, gate[ids], up[ids], down[ids])))
    full = expert_sum(x, idx, w, gate, up, down)  # other addition order: rounding only
    np.testing.assert_allclose(np.delete(got, 2, 0), np.delete(full, 2, 0), rtol=1e-5,
                               atol=1e-5 * np.abs(full[np.isfinite(full)]).max())
    lost = int(np.setdiff1d(np.arange(E), ids)[0])
    with pytest.raises(KeyError, match=rf"experts \[{lost}\] are not held"):
        shard.compute(4, x, np.where(np.arange(k) == 0, lost, idx), w)
    with pytest.raises(KeyError, match=r"layer 5"):
        shard.compute(5, x, idx, w)
    assert not shard.compute(5, x, np.full_like(idx, -1), w).any()


def test_sharded_experts_split_over_peers_on_the_host():
    """Two host workers, each holding half the experts: apply on either gives the full
    sum (each pick counted once, where it was made or served), counters say "host"."""
    rng = np.random.default_rng(8)
    E, H, I, N, k = 10, 24, 12, 17, 4
    gate, up, down = stacks(rng, E, H, I)
    owner = rng.permutation(np.arange(E) % 2).astype(np.int32)
    ranks = []
    for r in range(2):
        mine = np.flatnonzero(owner == r)[::-1]  # (rows not in id order)
        shard = ExpertShard(E)
        shard.put(1, mine, gate[mine], up[mine], down[mine])
        ranks.append(ShardedExperts(r, {1: owner}, shard))
    for r, ex in enumerate(ranks):
        peer = ranks[1 - r]
        ex.transport = LocalTransport({1 - r: types.SimpleNamespace(run_experts=peer.serve)})
    x = activations(rng, N, H)
    x[2] = 1.0  # (finite here: a NaN row would not compare)
    _, w = hostile_routing(rng, N, E, k)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(N)])  # a router's: k picks each
    idx[0] = np.flatnonzero(owner == 1)[:k]  # one token all remote for rank 0, all local for 1
    full = expert_sum(x, idx, w, gate, up, down)
    for ex in ranks:
        got = ex.apply(1, x, idx, w)
        np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5 * np.abs(full).max())
    c = [ex.counters() for ex in ranks]
    assert all(s["expert_device"] == "host" and ex.device == "host" for s, ex in zip(c, ranks))
    assert sum(s["served_picks"] for s in c) == sum(s["remote_picks"] for s in c) > 0
    assert all(s["local_picks"] + s["remote_picks"] == N * k for s in c)
    assert [s["expert_pins"] for s in c] == [int((owner == r).sum()) for r in range(2)]


def test_cuda_model_refuses_a_host_expert_provider():
    """A CudaModel hands its provider device activations: a host shard's is refused at
    set_experts, not met later as a CuPy conversion error inside a step."""
    from workers.cuda_model import CudaModel
    host = ShardedExperts(0, {}, ExpertShard(4))
    with pytest.raises(TypeError, match="device 'cuda'.*'host'"):
        CudaModel.set_experts(types.SimpleNamespace(layers=[]), host)


def split_pair(rng, E, H, I, layer=4):
    """(one shard holding `held`, a SplitShard holding the same experts: `dev_ids` in its
    device part, the rest in its host part; both parts numpy here, as the GPU test's device
    part is cupy), gate/up/down of all E, held ids (shuffled)."""
    gate, up, down = stacks(rng, E, H, I)
    held = rng.permutation(E)[:E - 2]
    one = ExpertShard(E)
    one.put(layer, held, gate[held], up[held], down[held])
    split = SplitShard(ExpertShard(E), ExpertShard(E))
    pinned = rng.random(len(held)) < 0.5
    pinned[:2] = [True, False]  # (both parts hold some)
    split.add(layer, held, gate[held], up[held], down[held], pinned=pinned)
    return one, split, (gate, up, down), held, pinned


def assert_rows_close(got, ref):
    """NaN in the same places; each row's finite values within 1e-5 of its largest |ref|
    (rows differ by 1e7 in scale); a zero row exactly zero."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    for n, (g, r) in enumerate(zip(got, ref)):
        fin = ~np.isnan(r)
        scale = np.abs(r[fin]).max() if fin.any() else 0.0
        assert np.abs(g[fin] - r[fin]).max(initial=0.0) <= 1e-5 * scale, n


@pytest.mark.parametrize("seed", range(4))
def test_split_shard_equals_one_shard_on_hostile_routing(seed):
    """Experts split between a device part and a host part give the one shard's sum
    (within the float32 rounding of another addition order): -1 picks anywhere, a token
    with none, experts picked by many tokens, a token all on host and one all on device;
    a NaN in a row that picks nothing stays out of every other row, and a NaN row that
    picks host experts only is NaN in its own row only."""
    rng = np.random.default_rng(40 + seed)
    E, H, I, N, k = 14, 40 + seed, 24, 31, 4
    one, split, _, held, pinned = split_pair(rng, E, H, I)
    assert split.count() == one.count() and split.nbytes() == one.nbytes()
    assert sorted(split.ids(4).tolist()) == sorted(held.tolist())
    assert split.dev.ids(4).tolist() == held[pinned].tolist()
    assert split.host.ids(4).tolist() == held[~pinned].tolist()
    x = activations(rng, N, H)
    idx, w = hostile_routing(rng, N, E, k)
    idx = np.where(np.isin(idx, held), idx, -1)
    host_ids, dev_ids = held[~pinned], held[pinned]
    idx[0] = -1
    idx[0, :min(k, len(host_ids))] = host_ids[:k]  # token 0 all on host
    idx[3] = -1
    idx[3, :min(k, len(dev_ids))] = dev_ids[:k]  # token 3 all on device
    idx[5] = -1
    idx[5, 1] = host_ids[0]  # token 5: one host pick
    x[1] = np.nan  # token 1 picks nothing: its NaN must not leak
    x[5] = np.nan  # token 5's NaN row reaches only its own output
    ref = one.compute(4, x, idx, w)
    got = split.compute(4, x, idx, w)
    assert got.dtype == np.float32 and got.shape == (N, H)
    assert not got[1].any() and np.isnan(got[5]).all()
    assert_rows_close(got, ref)
    assert np.isfinite(np.delete(got, [2, 5], axis=0)).all()
    assert split.host_picks(4, idx) == int(np.isin(idx, host_ids).sum()) > 0
    # an expert neither part holds is named, with what each part holds
    lost = int(np.setdiff1d(np.arange(E), held)[0])
    with pytest.raises(KeyError, match=rf"experts \[{lost}\] are not held here \(on the device"):
        split.compute(4, x, np.where(np.arange(k) == 0, lost, idx), w)
    assert not split.compute(7, x, np.full_like(idx, -1), w).any()  # a layer it holds none of


def test_split_shard_add_places_gained_experts_by_pinned():
    """reassign's add: gained pinned experts join the device part, the others the host
    part, and the shard computes them all as one shard would."""
    rng = np.random.default_rng(17)
    E, H, I, N, k = 12, 32, 16, 21, 3
    one, split, (gate, up, down), held, pinned = split_pair(rng, E, H, I)
    gained = np.setdiff1d(np.arange(E), held)[::-1]
    flags = np.array([False, True])
    with pytest.raises(ValueError, match="pinned has shape"):
        split.add(4, gained, gate[gained], up[gained], down[gained], pinned=flags[:1])
    split.add(4, gained, gate[gained], up[gained], down[gained], pinned=flags)
    one.add(4, gained, gate[gained], up[gained], down[gained])
    assert split.dev.ids(4).tolist() == held[pinned].tolist() + [int(gained[1])]
    assert split.host.ids(4).tolist() == held[~pinned].tolist() + [int(gained[0])]
    x = activations(rng, N, H)
    idx, w = hostile_routing(rng, N, E, k)
    idx[0, :2] = gained
    assert_rows_close(split.compute(4, x, idx, w), one.compute(4, x, idx, w))


def test_sharded_experts_over_a_split_shard_serve_and_count_host_picks():
    """ShardedExperts over a SplitShard (rank 0) and a host shard (rank 1): apply and a
    peer's serve both give the full sum; host_picks counts the picks rank 0's host part
    computed (its own and served), expert_pins / _device / _host what each holds."""
    rng = np.random.default_rng(23)
    E, H, I, N, k = 10, 24, 12, 27, 4
    gate, up, down = stacks(rng, E, H, I)
    owner = rng.permutation(np.arange(E) % 2).astype(np.int32)
    mine0 = rng.permutation(np.flatnonzero(owner == 0))
    pin0 = np.arange(len(mine0)) % 2 == 0
    split = SplitShard(ExpertShard(E), ExpertShard(E))
    split.add(1, mine0, gate[mine0], up[mine0], down[mine0], pinned=pin0)
    mine1 = np.flatnonzero(owner == 1)
    other = ExpertShard(E)
    other.put(1, mine1, gate[mine1], up[mine1], down[mine1])
    ranks = [ShardedExperts(0, {1: owner}, split), ShardedExperts(1, {1: owner}, other)]
    for r, ex in enumerate(ranks):
        ex.transport = LocalTransport({1 - r: types.SimpleNamespace(run_experts=ranks[1 - r].serve)})
    x = activations(rng, N, H)
    x[2] = 1.0
    _, w = hostile_routing(rng, N, E, k)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(N)])
    full = expert_sum(x, idx, w, gate, up, down)
    for ex in ranks:
        np.testing.assert_allclose(ex.apply(1, x, idx, w), full, rtol=1e-5, atol=1e-5 * np.abs(full).max())
    on_host0 = np.isin(idx, mine0[~pin0])
    c = [ex.counters() for ex in ranks]
    # rank 0's host part: its own apply's host picks + those it served for rank 1's apply
    assert c[0]["host_picks"] == 2 * int(on_host0.sum()) > 0
    assert c[1]["host_picks"] == 2 * int(np.isin(idx, mine1).sum())  # all of a host shard's
    assert (c[0]["expert_pins"], c[0]["expert_pins_host"] + c[0]["expert_pins_device"]) == (len(mine0),) * 2
    assert c[0]["expert_bytes"] == len(mine0) * 3 * H * I * 4
    assert (c[1]["expert_pins_host"], c[1]["expert_pins_device"], c[1]["expert_bytes_device"]) == (len(mine1), 0, 0)
