"""Planner: byte counts against published checkpoints, the C engine's KV table, expert
placement on a 2 x 141 GB node, and a property test over random fleets."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from cluster.cli import main
from cluster.footprint import WEIGHT_FORMATS, Footprint
from cluster.planner import (BLOCK, GB, DeviceBudget, PlanError, assign_experts, device_bytes, expert_order,
                             max_context, plan, split_experts)

CARDS = Path(__file__).resolve().parents[2] / "configs" / "models"


def card(name: str) -> Footprint:
    return Footprint.from_file(CARDS / f"{name}.json")


# --- the C engine's planning table -----------------------------------------------------

def test_glm52_kv_table_matches_c_engine():
    fp = card("glm-5.2")
    assert fp.cached_layers == 79  # 78 layers + 1 MTP
    want = {"f32": (2304, 47_714_402_304, 47.7), "kv8": (584, 12_094_275_584, 12.1),
            "tq4": (296, 6_129_975_296, 6.1)}
    for tier, (tok, pool, shown) in want.items():
        assert fp.kv_token_bytes(tier) == tok
        assert fp.kv_pool_bytes(tier, 1, 262_144) == tok * 79 * 262_144 == pool
        assert round(pool / 1e9, 1) == shown


def test_cli_pool_json_reproduces_table(capsys):
    for tier, pool in (("f32", 47_714_402_304), ("kv8", 12_094_275_584), ("tq4", 6_129_975_296)):
        assert main(["plan", "--model-config", str(CARDS / "glm-5.2.json"), "--ctx", "262144",
                     "--kv", tier, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["kv_pool_bytes"] == pool and out["cached_layers"] == 79
        assert out["kv_bytes_per_token"] == pool // 262_144
        assert out["tiers"][tier]["kv_pool_bytes"] == pool
    assert main(["plan", "--model-config", str(CARDS / "glm-5.2.json"), "--ctx", "1000", "--slots", "3",
                 "--kv", "kv8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_pool_bytes"] == 3 * 1000 * 79 * 584
    assert out["index_pool_bytes"] == 3 * 1000 * 22 * 128 * 4


def test_cli_tables_show_small_sizes_of_the_tiny_model(capsys):
    """The tiny shipped model's pools are a few MB: every tier printed as 0.0 GB, and the
    fleet table's kv column as 0.00."""
    mini = Path(__file__).resolve().parents[2] / "models" / "kvfleet-mini" / "config.json"
    assert main(["plan", "--model-config", str(mini), "--ctx", "2048"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[2:] for line in out.splitlines()[2:]}
    fp = Footprint.from_file(mini)
    assert fp.kv_pool_bytes("f32", 1, 2048) == 18_874_368 and rows["f32"] == ["18.9", "MB", "<"]
    assert fp.kv_pool_bytes("polar2", 1, 2048) == 950_272 and rows["polar2"] == ["950.3", "kB"]
    assert "0 layers, 0 B/token, 0 B (not in the KV pool)" in out
    # a fleet table cell that is not zero but below 0.005 GB reads <0.01, not 0.00
    assert main(["plan", "--config", str(CARDS.parent / "fleets" / "local-sharded.yaml"),
                 "--model-config", str(mini), "--ctx", "1024", "--kv", "tq4"]) == 0
    out = capsys.readouterr().out
    cpu0 = next(line for line in out.splitlines() if line.startswith("host/cpu0")).split()
    assert cpu0[5:8] == ["<0.01", "0.00", "0.00"]  # kv 4.85 MB; no indexer, no shadow
    assert "24 routed experts of 73.7 kB (bf16)" in out


# --- weight bytes against published checkpoints ----------------------------------------

def test_weights_match_published_checkpoints():
    # GLM-5.1 weight listing: 753,864,139,008 parameters.
    assert card("glm-5.1").param_count() == 753_864_139_008
    # GLM-5.2 checkpoint: 1,506,659,919,872 tensor bytes (bf16, router bias f32).
    g52 = card("glm-5.2")
    assert g52.dense_bytes + g52.routed_experts * g52.expert_bytes("bf16") == 1_506_659_919_872
    # Kimi-K2-Instruct: 1,026,408,232,448 parameters.
    assert card("kimi-k2").param_count() == 1_026_408_232_448
    # DeepSeek-V3/R1 listing: 684,531,386,000 stored elements = weights + fp8 block scales
    # (41,540,496) + the MTP layer's stored copies of embed_tokens and lm_head.
    ds = card("deepseek-v3")
    assert ds.param_count() + 41_540_496 + 2 * 129_280 * 7168 == 684_531_386_000


def test_expert_formats():
    fp = card("glm-5.2")  # gate/up [2048, 6144], down [6144, 2048]
    n = 3 * 2048 * 6144
    assert fp.expert_bytes("bf16") == 2 * n
    assert fp.expert_bytes("fp8") == n + 3 * (16 * 48) * 4  # one f32 per 128x128 block
    assert fp.expert_bytes("int4") == n // 2 + (2 * 2048 * 192 + 6144 * 64) * 2  # bf16 per 32 inputs
    assert WEIGHT_FORMATS["int4"].matrix_bytes(7, 34) == 7 * 34 // 2 + 7 * 2 * 2  # 2 groups per row
    with pytest.raises(ValueError, match="whole bytes"):
        WEIGHT_FORMATS["int4"].matrix_bytes(7, 33)
    with pytest.raises(ValueError, match="int8"):
        fp.expert_bytes("int8")


def test_indexer_layers_follow_indexshare():
    g52 = card("glm-5.2")
    want = (0, 1, 2, *range(6, 78, 4), 78)
    assert g52.indexer_layers == want and len(want) == 22
    # MoE layers 3..77 plus the MTP layer 78 (mlp_layer_types lists only the 78 main layers)
    assert g52.moe_layers == tuple(range(3, 79)) and card("deepseek-v3").moe_layers == tuple(range(3, 62))
    assert card("kimi-k2").moe_layers == tuple(range(1, 61))
    raw = json.loads((CARDS / "glm-5.2.json").read_text())
    del raw["indexer_types"]  # the index_topk_freq / index_skip_topk_offset rule gives the same
    assert Footprint.from_dict(raw).indexer_layers == want
    assert card("glm-5.1").indexer_layers == tuple(range(79))
    assert card("deepseek-v3").indexer_layers == () and card("deepseek-v3").index_bytes_per_token == 0
    raw["indexer_types"] = ["full"] * 5
    with pytest.raises(ValueError, match="indexer_types"):
        Footprint.from_dict(raw, source="bad.json")


# --- GLM-5.2 on one node with two 141 GB H200s -----------------------------------------

def test_two_h200_glm52_int4_pins(capsys):
    fp = card("glm-5.2")
    devs = [DeviceBudget(f"h200/cuda{i}", "cuda", 141 * GB, 4 * GB, slots=1) for i in range(2)]
    p = plan(fp, devs, tier="kv8", ctx=131_072, experts="int4")
    eb = fp.expert_bytes("int4")
    room = 137 * GB - fp.dense_bytes - 131_072 * (79 * 584 + 22 * 512 + 79 * 584)  # kv + index + shadow
    for d in p.devices:
        assert len(d.pinned) == room // eb == 4033
        assert 0 <= d.free_bytes < eb
        assert d.shadow_bytes == d.kv_pool_bytes == 131_072 * 79 * 584
    assert len(p.host) == fp.run_experts - 2 * 4033 == 11_134  # (the MTP layer's 256: not planned)
    with capsys.disabled():
        print(f"\n2 x H200 141 GB, GLM-5.2 int4 experts, kv8, 1 slot x 131072: "
              f"{[len(d.pinned) for d in p.devices]} experts pinned per GPU, {len(p.host)} on host")


def test_mtp_experts_take_no_room_from_the_experts_that_run(capsys):
    """GLM-5.2 (num_nextn_predict_layers=1): the plan pinned 106 experts of MTP layer 78 on
    the second H200 (2.2 GB of room that its run experts could have had; the job's split
    then dropped them, so that worker pinned 106 fewer than its room holds) and counted the
    layer's 256 in routed_experts and 150 in host_experts, though no kvfleet job loads them.
    Hostile usage counts that make the MTP layer the most used change nothing."""
    fp = card("glm-5.2")
    assert fp.config.num_nextn_predict_layers == 1 and 78 in fp.moe_layers
    assert fp.run_moe_layers == tuple(range(3, 78)) and fp.run_experts == 75 * 256
    eb = fp.expert_bytes("int4")
    devs = [DeviceBudget(f"h200/cuda{i}", "cuda", 141 * GB, 4 * GB, slots=1) for i in range(2)]
    rng = np.random.default_rng(78)
    usage = rng.poisson(5.0, (len(fp.moe_layers), 256)).astype(float)
    usage[-1] = 1e9  # the MTP layer's row (the checkpoint's MoE layers) counted hottest
    plans = [plan(fp, devs, tier="kv8", ctx=131_072, experts="int4", usage=u)
             for u in (None, usage, usage[:-1])]
    for p in plans:
        placed = np.concatenate([*(d.pinned for d in p.devices), p.host])
        assert len(placed) == len({tuple(x) for x in placed.tolist()}) == 19_200
        assert placed[:, 0].max() == 77 and placed[:, 0].min() == 3  # MTP layer 78: never placed
        for d in p.devices:  # the whole room goes to experts that run
            assert len(d.pinned) == (d.free_bytes + d.pinned_bytes) // eb == 4033 and d.free_bytes < eb
        d = p.to_dict()
        assert (d["routed_experts"], d["mtp_experts"], d["moe_layers"]) == (19_200, 256, 75)
        assert d["pinned_experts"] + d["host_experts"] == 19_200
        assert all(sorted(map(int, v["pinned_per_layer"])) == list(range(3, 78)) for v in d["devices"])
    # counts with the MTP row or without it: the same plan (the row is left out)
    assert all((a.pinned == b.pinned).all() for a, b in zip(plans[1].devices, plans[2].devices))
    # the job's split (cluster/placement.py) gets the same: every room spent on run experts
    a = split_experts(fp, [4033 * eb + eb // 2] * 2, "int4")
    assert a.pinned.sum() == 8066 and a.experts[:, 0].max() == 77
    assert main(["plan", "--config", str(CARDS.parent / "fleets" / "h200x2.yaml")]) == 0
    out = capsys.readouterr().out
    assert "75 MoE layers, 19200 routed experts" in out and "(+ 256 in MTP layers" in out
    assert "experts: 8066 of 19200 pinned on devices, 11134 served from host memory" in out


# --- placement ---------------------------------------------------------------------------

def test_cli_usage_that_is_not_counts_is_a_usage_error(tmp_path, capsys):
    """--usage holding a JSON object or a .npy of strings was a TypeError / ValueError
    traceback (the ValueError from inside the planner)."""
    (tmp_path / "u.json").write_text('{"layer3": [1, 2]}')
    np.save(tmp_path / "u.npy", np.array([["a", "b"]]))
    fleet = Path(__file__).resolve().parents[2] / "configs" / "fleets" / "h200x2.yaml"
    for name in ("u.json", "u.npy"):
        assert main(["plan", "--config", str(fleet), "--usage", str(tmp_path / name)]) == 2
        assert f"--usage {tmp_path / name}: cannot read expert usage counts" in capsys.readouterr().err


@pytest.mark.parametrize("counts, said", [
    (-np.ones((75, 256)), r"must be finite and >= 0, got -1.0 at row 0, expert 0 \(19200 such\)"),
    (np.pad(np.ones((75, 255)), ((0, 0), (0, 1)), constant_values=np.nan),
     r"must be finite and >= 0, got nan at row 0, expert 255 \(75 such\)"),
    (np.ones((3, 4)), r"must have shape \(75, 256\) or \(76, 256\) \(MoE layers x routed "
                      r"experts\), got shape \(3, 4\)"),
    (np.ones(256), r"must have shape .* got shape \(256,\)"),
])
def test_cli_usage_counts_that_the_plan_cannot_use_name_the_flag_and_file(tmp_path, capsys,
                                                                          counts, said):
    """Negative counts were taken (ranked last), and a wrong shape or a NaN was the
    planner's message naming neither --usage nor the file."""
    fleet = Path(__file__).resolve().parents[2] / "configs" / "fleets" / "h200x2.yaml"
    for name in ("u.npy", "u.json"):
        path = tmp_path / name
        if name.endswith(".npy"):
            np.save(path, counts)
        else:  # (json writes and reads NaN)
            path.write_text(json.dumps(counts.tolist()))
        assert main(["plan", "--config", str(fleet), "--usage", str(path)]) == 2
        err = capsys.readouterr().err
        assert re.match(f"kvfleet plan: error: --usage {path}: expert usage counts {said}", err), err
        assert len(err.splitlines()) == 1
    for rows in (75, 76):  # per MoE layer run, or of the checkpoint (its MTP layer too)
        np.save(tmp_path / "ok.npy", np.arange(rows * 256, dtype=np.float64).reshape(rows, 256))
        assert main(["plan", "--config", str(fleet), "--usage", str(tmp_path / "ok.npy")]) == 0
        capsys.readouterr()


def test_assign_experts_biggest_budget_first():
    experts = expert_order([3, 4], 4, usage=np.array([[9, 1, 5, 0], [2, 8, 7, 3]]))
    assert experts.tolist() == [[3, 0], [4, 1], [4, 2], [3, 2], [4, 3], [4, 0], [3, 1], [3, 3]]
    a = assign_experts([10, 25], 5, experts)
    # budgets 10/25 -> w1 (20) w1 (15) w1 (10), tie 10/10 -> w0 (5), w1 (5), tie -> w0 (0),
    # w1 (0); 35 bytes hold 7 experts; the last goes to w0 (tie at 0) unpinned.
    assert a.owner.tolist() == [1, 1, 1, 0, 1, 0, 1, 0]
    assert a.pinned.tolist() == [True] * 7 + [False]
    assert sorted(map(tuple, np.concatenate([a.shard(0), a.shard(1)]).tolist())) == sorted(map(tuple, experts.tolist()))


def test_expert_order_spreads_without_usage():
    layers = [3, 5, 6, 9]
    order = expert_order(layers, 7)
    for k in (1, 5, 11, 27):
        counts = np.bincount(np.searchsorted(layers, order[:k, 0]), minlength=4)
        assert counts.max() - counts.min() <= 1
    with pytest.raises(PlanError, match="shape"):
        expert_order(layers, 7, usage=np.ones((4, 6)))


# --- budgets, shadow, errors -------------------------------------------------------------

def test_shadow_floor_and_kinds():
    fp = card("glm-5.2")
    big = DeviceBudget("big", "cuda", 80 * GB)
    small = DeviceBudget("small", "cuda", 31 * GB)
    host = DeviceBudget("host", "cpu", 512 * GB)
    assert big.has_shadow(32 * GB) and not small.has_shadow(32 * GB) and not host.has_shadow(32 * GB)
    p = plan(fp, [big, host], tier="tq4", ctx=4096)
    assert p.devices[0].shadow_bytes == 4096 * 79 * 584 and p.devices[1].shadow_bytes == 0


def test_plan_error_names_device_need_and_budget():
    fp = card("glm-5.2")
    with pytest.raises(PlanError, match=r"device tiny/cuda0: dense weights need 37\.78 GB but its budget is 20\.00 GB"):
        plan(fp, [DeviceBudget("tiny/cuda0", "cuda", 24 * GB, 4 * GB)], tier="kv8", ctx=1024)
    with pytest.raises(PlanError, match=r"device a: .*KV pool .* exceed its budget .*longest context"):
        plan(fp, [DeviceBudget("a", "cuda", 80 * GB, 4 * GB, slots=4)], tier="f32", ctx=262_144)


def test_max_context_is_the_largest_block_that_fits():
    fp = card("deepseek-v3")
    dev = DeviceBudget("d", "cuda", 80 * GB, 4 * GB, slots=2)
    for tier in ("f32", "kv8", "tq4"):
        n = max_context(fp, dev, tier)
        assert n % BLOCK == 0 and n > 0
        assert plan(fp, [dev], tier=tier, ctx=n).devices[0].free_bytes >= 0
        with pytest.raises(PlanError):
            plan(fp, [dev], tier=tier, ctx=n + BLOCK)


# --- property test: random fleets ----------------------------------------------------------

def random_model(rng: np.random.Generator) -> Footprint:
    layers, nextn = int(rng.integers(1, 7)), int(rng.integers(0, 2))
    dsa = rng.random() < 0.5
    raw = {
        "model_type": "deepseek_v3", "vocab_size": int(rng.integers(50, 400)), "hidden_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": int(rng.integers(1, 5)),
        "q_lora_rank": None if rng.random() < 0.3 else 32, "kv_lora_rank": int(rng.choice([16, 32, 64])),
        "qk_nope_head_dim": 16, "qk_rope_head_dim": int(rng.choice([8, 16])), "v_head_dim": 16,
        "intermediate_size": 96, "n_routed_experts": int(rng.integers(2, 17)), "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "first_k_dense_replace": int(rng.integers(0, layers + 1)),
        "num_nextn_predict_layers": nextn, "n_group": 1, "topk_group": 1,  # (DeepseekV3's 8 / 4 need experts in 8 groups)
        **({"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8} if dsa else {}),
    }
    return Footprint.from_dict(raw, source="random")


def test_random_fleets_never_overbook_and_place_every_expert_once():
    rng = np.random.default_rng(20261130)
    planned = refused = 0
    for case in range(300):
        fp = random_model(rng)
        n_dev = int(rng.integers(1, 6))
        devs = [DeviceBudget(f"n{case}/d{i}", str(rng.choice(["cuda", "cpu", "metal"])),
                             int(rng.integers(1, 40) * 10**6), int(rng.integers(0, 3) * 10**6),
                             slots=int(rng.integers(1, 5))) for i in range(n_dev)]
        tier = str(rng.choice(["f32", "kv8", "tq4", "polar3"]))
        ctx, fmt = int(rng.integers(1, 300)), str(rng.choice(["bf16", "fp8", "int4"]))
        # counts per run MoE layer, or per MoE layer of the checkpoint (its MTP rows ignored)
        counted = fp.run_moe_layers if rng.random() < 0.5 else fp.moe_layers
        usage = rng.poisson(3.0, (len(counted), fp.config.n_routed_experts)) if rng.random() < 0.5 else None
        floor = int(rng.integers(0, 40) * 10**6)
        try:
            p = plan(fp, devs, tier=tier, ctx=ctx, experts=fmt, usage=usage, shadow_floor_bytes=floor)
        except PlanError as e:
            refused += 1
            held = -(-ctx // BLOCK) * BLOCK  # (the pool holds whole blocks)
            bad = [d for d in devs if fp.dense_bytes + d.slots * held * (
                fp.kv_bytes_per_token(tier) + fp.index_bytes_per_token
                + (fp.kv_bytes_per_token("kv8") if d.kind == "cuda" and d.memory_bytes >= floor else 0)) > d.capacity]
            assert bad and bad[0].name in str(e)
            continue
        planned += 1
        eb = fp.expert_bytes(fmt)
        for d in p.devices:
            assert d.used_bytes <= d.device.capacity and d.free_bytes >= 0
            assert d.pinned_bytes == len(d.pinned) * eb
            if len(p.host):
                assert d.free_bytes < eb  # nothing left on host that this device could still pin
        placed = [tuple(x) for d in p.devices for x in d.pinned.tolist()] + [tuple(x) for x in p.host.tolist()]
        everything = {(l, e) for l in fp.run_moe_layers for e in range(fp.config.n_routed_experts)}
        assert len(placed) == len(set(placed)) == len(everything) and set(placed) == everything
        if usage is not None and len(p.host) and len(p.host) < fp.run_experts:
            u = {(l, e): usage[i, e] for i, l in enumerate(fp.run_moe_layers) for e in range(usage.shape[1])}
            pinned_min = min(u[tuple(x)] for d in p.devices for x in d.pinned.tolist())
            assert pinned_min >= max(u[tuple(x)] for x in p.host.tolist())
    assert planned > 50 and refused > 20  # both paths exercised


def test_plan_rejects_bad_inputs():
    fp = card("kimi-k2")
    with pytest.raises(PlanError, match="unique"):
        plan(fp, [DeviceBudget("a", "cpu", 900 * GB)] * 2, tier="f32", ctx=16)
    with pytest.raises(PlanError, match="kind"):
        DeviceBudget("a", "tpu", GB)
    with pytest.raises(ValueError, match="unknown KV tier"):
        plan(fp, [DeviceBudget("a", "cpu", 900 * GB)], tier="kv4", ctx=16)
    assert math.isclose(fp.expert_bytes("int4") / (3 * 2048 * 7168), 0.5625)


def test_split_experts_for_the_runtime():
    fp = card("glm-5.2")
    eb = fp.expert_bytes("fp8")
    caps = [100 * eb + 7, 3000 * eb, 0]
    a = split_experts(fp, caps, "fp8")
    assert len(a.experts) == fp.run_experts == 19_200  # 75 MoE layers x 256; MTP layer 78's are not run
    assert np.bincount(a.owner[a.pinned], minlength=3).tolist() == [100, 3000, 0]
    shards = [set(map(tuple, a.shard(w).tolist())) for w in range(3)]
    assert sum(map(len, shards)) == 19_200 and len(set().union(*shards)) == 19_200  # exactly one owner each
    assert set(a.experts[:, 0].tolist()) == set(range(3, 78))
    # the unpinned remainder is spread so that the budgets (going negative) stay level
    left = np.array(caps) - np.bincount(a.owner, minlength=3) * eb
    assert left.max() - left.min() <= eb + 7


def test_plan_deals_tiny_experts_evenly_as_the_job_splits_them(capsys):
    """configs/fleets/local-sharded.yaml with kvfleet-mini: the plan pinned all 24 experts on
    the metal worker (2 slots: the least KV, so the most free bytes, for every expert in
    turn) while the job's split deals them out 8 / 8 / 8; plan and job now split alike."""
    from cluster.fleet import Fleet, plan_fleet
    mini = Path(__file__).resolve().parents[2] / "models" / "kvfleet-mini" / "config.json"
    fleet, fp = Fleet.from_file(CARDS.parent / "fleets" / "local-sharded.yaml"), Footprint.from_file(mini)
    p = plan_fleet(fleet, fp, tier="tq4", ctx=1024, experts="bf16")
    assert [d.kv_pool_bytes for d in p.devices] == [4 * 1024 * 4 * 296] * 2 + [2 * 1024 * 4 * 296]
    assert [len(d.pinned) for d in p.devices] == [8, 8, 8] and not len(p.host) and p.experts_even
    rooms = [d.free_bytes + d.pinned_bytes for d in p.devices]  # what placement gives the job
    job = split_experts(fp, rooms, "bf16")
    for w, d in enumerate(p.devices):
        assert sorted(map(tuple, d.pinned.tolist())) == sorted(map(tuple, job.shard(w).tolist()))
        assert sorted(d.to_dict(fp.moe_layers)["pinned_per_layer"].values()) == [2, 3, 3]
    assert main(["plan", "--config", str(CARDS.parent / "fleets" / "local-sharded.yaml"), "--model-config",
                 str(mini), "--ctx", "1024", "--kv", "tq4"]) == 0
    assert "24 of 24 pinned on devices, 0 served from host memory; dealt out evenly" in capsys.readouterr().out
    # when an even share does not fit every device, most room first (as before)
    base, eb = fp.dense_bytes + fp.kv_pool_bytes("f32", 1, 16), fp.expert_bytes("bf16")
    small = [DeviceBudget("a", "cpu", base + 10 * eb), DeviceBudget("b", "cpu", base + 20 * eb)]
    q = plan(fp, small, tier="f32", ctx=16)  # 12 each does not fit a: b fills to a's level first
    assert not q.experts_even and [len(d.pinned) for d in q.devices] == [7, 17] and not len(q.host)


def test_ctx_past_max_position_warns():
    p = plan(card("deepseek-v3"), [DeviceBudget("h", "cpu", 3000 * GB)], tier="tq4", ctx=200_000)
    assert p.to_dict()["warnings"] == ["ctx 200000 exceeds the model's max_position_embeddings 163840"]
    assert plan(card("deepseek-v3"), [DeviceBudget("h", "cpu", 3000 * GB)], tier="tq4", ctx=4096).warnings == []


def test_context_is_counted_in_whole_blocks_as_the_pool_holds_it():
    """A slot holds whole blocks (KVPool.for_model: ceil(ctx / 16) each), so a ctx of 17
    takes 32 tokens of pool: the plan counts those bytes, and a budget that fits only 17
    tokens per slot is refused instead of planned with 0 bytes free."""
    from kvstore.pool import KVPool
    fp = Footprint.from_file(Path(__file__).resolve().parents[2] / "models/kvfleet-mini/config.json")
    ctx, slots, per = 17, 2, fp.kv_bytes_per_token("f32")
    pool = KVPool.for_model(fp.config, "f32", slots, ctx)
    pool_bytes = pool.n_blocks * pool.block_size * pool.bytes_per_token()
    assert pool_bytes == slots * 32 * per
    fits = fp.dense_bytes + pool_bytes
    p = plan(fp, [DeviceBudget("d", "cpu", fits, 0, slots)], tier="f32", ctx=ctx)
    assert p.devices[0].kv_pool_bytes == pool_bytes and p.devices[0].free_bytes >= 0
    with pytest.raises(PlanError, match="exceed its budget"):
        plan(fp, [DeviceBudget("d", "cpu", fp.dense_bytes + slots * ctx * per, 0, slots)],
             tier="f32", ctx=ctx)


def test_even_share_with_a_remainder_goes_to_the_roomiest_workers():
    """24 kvfleet-mini experts (3 MoE layers x 8) on 5 workers: shares 5, 5, 5, 5, 4. The
    old test asked every worker for room for the rounded-up share (5), so one worker with
    room for exactly 4 sent the split to most room first, and the roomy worker took all 24;
    the remainder now goes to the workers with the most room, wherever they stand."""
    mini = Path(__file__).resolve().parents[2] / "models" / "kvfleet-mini" / "config.json"
    fp = Footprint.from_file(mini)
    eb, n = fp.expert_bytes("bf16"), fp.routed_experts
    for rooms in ([100 * eb, 4 * eb, 5 * eb, 5 * eb, 5 * eb], [5 * eb, 5 * eb, 4 * eb, 5 * eb, 100 * eb]):
        a = split_experts(fp, rooms, "bf16")
        counts = np.bincount(a.owner, minlength=5)
        assert sorted(counts.tolist()) == [4, 5, 5, 5, 5] and a.pinned.all() and a.even
        assert counts[rooms.index(4 * eb)] == 4 and (counts * eb <= np.array(rooms)).all()
        shards = [a.shard(w) for w in range(5)]  # each (layer, expert) exactly once, layer by layer
        both = np.concatenate(shards)
        assert len(both) == n and len({tuple(x) for x in both.tolist()}) == n
        assert all((np.diff(s[:, 0] * 1000 + s[:, 1]) > 0).all() for s in shards)
    # a share that does not fit one worker at all: most room first, as before
    a = split_experts(fp, [100 * eb, 3 * eb, 5 * eb, 5 * eb, 5 * eb], "bf16")
    assert not a.even and np.bincount(a.owner, minlength=5).tolist() == [24, 0, 0, 0, 0]


@pytest.mark.parametrize("loaded", [False, True])
def test_host_bytes_equal_the_loaded_arrays_of_each_worker(loaded):
    """The plan's host figure is what a kvfleet job's workers really hold: the float32 arrays
    of workers/weights.py (twice the bf16 checkpoint the budget counts), every routed expert a
    cpu or metal worker owns, and on a cpu device the dense weights; a cuda worker keeps the
    experts the plan pins on its GPU and reads the others into host memory (read_experts, as
    workers/ep_worker.py does). With `loaded` (the job's own plan) a cuda device's pinned
    bytes are the float32 stacks its CudaModel uploads, and its dense weights float32 too;
    without, the checkpoint's bf16 (kvfleet plan). Measured by loading each worker's shard of
    kvfleet-mini as the workers do."""
    from workers.expert_shard import read_experts
    from workers.weights import load_params
    mini = Path(__file__).resolve().parents[2] / "models" / "kvfleet-mini"
    fp = Footprint.from_file(mini)
    kv = 64 * BLOCK * fp.kv_bytes_per_token("kv8")
    # uneven budgets, so the split is most-room-first, the shards differ in size and the cuda
    # device owns experts it does not pin
    budget = lambda kind, n: (lambda d, e: d + kv + int(n * e))(*device_bytes(fp, kind, "bf16", loaded))  # noqa: E731
    devs = [DeviceBudget("c0", "cpu", budget("cpu", 13)), DeviceBudget("g0", "cuda", budget("cuda", 3.5)),
            DeviceBudget("c1", "cpu", budget("cpu", 2))]
    p = plan(fp, devs, tier="kv8", ctx=64 * BLOCK, experts="bf16", loaded=loaded)
    assert not p.experts_even and len(p.host) > 0  # some experts left to the host as well
    sizes = [device_bytes(fp, d.kind, "bf16", loaded)[1] for d in devs]
    a = split_experts(fp, [d.free_bytes + d.pinned_bytes for d in p.devices], "bf16", expert_bytes=sizes)
    d = p.to_dict()
    assert d["host_dtype"] == "float32"
    total = 0
    for w, (dp, row) in enumerate(zip(p.devices, d["devices"])):
        kind = dp.device.kind
        owned = lambda keep: {l: a.experts[keep & (a.owner == w) & (a.experts[:, 0] == l), 1]  # noqa: E731
                              for l in fp.moe_layers if l < fp.config.num_hidden_layers}
        mine = owned(np.ones(len(a.owner), bool))
        assert sum(len(v) for v in mine.values()) > 0
        if kind == "cuda":
            pinned, rest = owned(a.pinned), owned(~a.pinned)
            held = sum(x.nbytes for st in read_experts(mini, fp.config, rest).values() for x in st)
            on_gpu = load_params(mini, fp.config, experts=pinned)  # what CudaModel uploads
            gpu_experts = sum(v.nbytes for k, v in on_gpu.items() if ".experts." in k)
            assert dp.pinned_bytes == (gpu_experts if loaded else gpu_experts // 2) > 0
            gpu_dense = sum(v.nbytes for k, v in on_gpu.items() if ".experts." not in k)
            assert dp.dense_bytes == (gpu_dense if loaded else fp.dense_bytes)
            assert held > 0  # (it owns experts it does not pin)
        else:
            params = load_params(mini, fp.config, experts=mine)
            held = sum(v.nbytes for k, v in params.items() if ".experts." in k or kind == "cpu")
            assert dp.dense_bytes == fp.dense_bytes
        assert dp.host_bytes == row["host_bytes"] == held, dp.device.name
        total += held
    assert d["host_bytes"] == total
    # against the bf16 the budget counts: a cpu device holds twice its dense weights, less
    # the float32 router bias that is float32 in both
    bias = 4 * fp.config.n_routed_experts * len(fp.moe_layers)
    assert sum(v.nbytes for k, v in load_params(mini, fp.config).items() if ".experts." not in k) \
        == 2 * fp.dense_bytes - bias


def test_cpu_device_over_budget_in_float32_is_warned(capsys):
    """A cpu device whose bf16 plan fits but whose float32 weights do not gets a warning that
    names it (the placement itself is unchanged), in the JSON and in the table."""
    mini = Path(__file__).resolve().parents[2] / "models" / "kvfleet-mini"
    fp = Footprint.from_file(mini)
    kv = BLOCK * fp.kv_bytes_per_token("f32")
    all_bf16 = fp.dense_bytes + kv + fp.routed_experts * fp.expert_bytes("bf16")
    p = plan(fp, [DeviceBudget("tight", "cpu", all_bf16)], tier="f32", ctx=BLOCK, experts="bf16")
    assert len(p.host) == 0 and p.devices[0].free_bytes == 0  # every expert pinned: it fits in bf16
    assert p.devices[0].host_bytes + kv > all_bf16
    assert any(w.startswith("device tight: a kvfleet job holds its weights as float32") for w in p.warnings)
    roomy = plan(fp, [DeviceBudget("big", "cpu", 3 * all_bf16)], tier="f32", ctx=BLOCK, experts="bf16")
    assert roomy.warnings == []


def test_metal_device_over_budget_in_float32_is_warned():
    """A metal device's budget is a Mac's one unified memory: its worker's float32 experts
    (numpy) and float32 dense weights (MLX's copy, workers/mlx_model.py) both live in it. Only
    cpu devices were checked, so a Mac planned on bf16 got no warning at 2x over. The figure
    is what its worker loads: every array of load_params when it owns every expert."""
    from workers.weights import load_params
    mini = Path(__file__).resolve().parents[2] / "models" / "kvfleet-mini"
    fp = Footprint.from_file(mini)
    kv = BLOCK * fp.kv_bytes_per_token("f32")
    held = sum(v.nbytes for v in load_params(mini, fp.config).values())
    all_bf16 = fp.dense_bytes + kv + fp.run_experts * fp.expert_bytes("bf16")
    p = plan(fp, [DeviceBudget("mac", "metal", all_bf16)], tier="f32", ctx=BLOCK, experts="bf16")
    assert len(p.host) == 0 and p.devices[0].free_bytes == 0  # it fits in bf16
    assert p.devices[0].host_bytes + kv < all_bf16  # (its host experts alone would fit)
    assert [w for w in p.warnings if w.startswith("device mac: a kvfleet job holds its weights as float32 "
                                                  f"({held / GB:.2f} GB with the dense weights MLX holds")]
    for budget, warned in ((held + kv - 1, True), (held + kv, False)):
        q = plan(fp, [DeviceBudget("mac", "metal", budget)], tier="f32", ctx=BLOCK, experts="bf16")
        assert bool(q.warnings) == warned, budget


@pytest.mark.parametrize("kv_lora", [511, 384, 4096])
def test_tiers_a_models_widths_cannot_use_are_unavailable(tmp_path, capsys, kv_lora):
    """tq4 and polar rotate rows, which needs power-of-two widths 2..2048; the KV pool refuses
    any other width. The pool table computed every tier (a TierError traceback for an odd
    kv_lora_rank) and planned tq4 / polar for widths the job's pool then refused; such tiers
    now show as unavailable, and asking for one is an error naming the flag or field."""
    from kernels.tiers import TIERS
    from kvstore.pool import KVPool
    raw = json.loads((Path(__file__).resolve().parents[2] / "models/kvfleet-mini/config.json").read_text())
    card_path = tmp_path / "odd.json"
    card_path.write_text(json.dumps({**raw, "kv_lora_rank": kv_lora}))
    fp = Footprint.from_file(card_path)
    usable = {}
    for t in TIERS:  # what the job's pool takes decides
        try:
            KVPool.for_model(fp.config, t, 1, 16)
            usable[t] = True
        except ValueError:
            usable[t] = False
    assert [t for t, ok in usable.items() if not ok] == ["tq4", *(f"polar{b}" for b in range(2, 7))]
    assert main(["plan", "--model-config", str(card_path), "--ctx", "1000", "--json"]) == 0
    tiers = json.loads(capsys.readouterr().out)["tiers"]
    for t, ok in usable.items():
        if ok:
            assert tiers[t]["kv_pool_bytes"] == 1000 * fp.kv_bytes_per_token(t)
        else:
            assert tiers[t]["kv_pool_bytes"] is None and "power-of-two" in tiers[t]["unavailable"]
    assert main(["plan", "--model-config", str(card_path), "--ctx", "1000"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["tq4"][0] == "unavailable" and rows["polar3"][0] == "unavailable"
    assert rows["kv8"][0] == str(fp.kv_bytes_per_token("kv8"))
    for tier in ("tq4", "polar5"):
        assert main(["plan", "--model-config", str(card_path), "--ctx", "1000", "--kv", tier]) == 2
        err = capsys.readouterr().err
        assert f"--kv {tier}: tier {tier} rotates rows" in err and f"kv_lora_rank {kv_lora}" in err
        assert "Traceback" not in err
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("plan: {ctx: 64, kv: polar4}\nnodes:\n  - {name: h, kind: cpu, memory: 4}\n")
    assert main(["plan", "--config", str(fleet), "--model-config", str(card_path)]) == 2
    err = capsys.readouterr().err
    assert f"{fleet}: plan.kv: tier polar4 rotates rows" in err and "Traceback" not in err
    assert main(["plan", "--config", str(fleet), "--model-config", str(card_path), "--kv", "tq4"]) == 2
    assert "--kv tq4: tier tq4 rotates rows" in capsys.readouterr().err
    assert main(["plan", "--config", str(fleet), "--model-config", str(card_path), "--kv", "kv8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert set(d["max_ctx"]) == {"f32", "kv8"} and d["kv_pool_bytes"] == 64 * fp.kv_bytes_per_token("kv8")
    assert main(["plan", "--config", str(fleet), "--model-config", str(card_path), "--kv", "f32"]) == 0
    assert capsys.readouterr().out.splitlines()[3].endswith("/-")  # max ctx f32/kv8/tq4: tq4 shows -
    with pytest.raises(PlanError, match="tier tq4 rotates rows"):
        plan(fp, [DeviceBudget("h", "cpu", 4 * GB)], tier="tq4", ctx=64)


@pytest.mark.parametrize("tier", ["kv8", "tq4", "f32"])
def test_the_jobs_plan_counts_the_kv_pool_its_workers_allocate(tier):
    """The job's plan (loaded: cluster/placement.py, kvfleet plan --as-job) counts a device's
    KV as its worker's pool allocates it: KVPool.for_model's planes (DevicePool's are the same
    shapes on the GPU; bytes_capacity, as the pool counts them), the main layers only (a
    kvfleet job runs no MTP layer), and no DSA indexer rows (it computes none). It counted
    the C engine's 79 layers and GLM-5.2's 22 indexer layers: room the experts it could pin
    never got. `kvfleet plan` keeps the C engine's sizes."""
    from kvstore.pool import KVPool
    fp = card("glm-5.2")
    assert fp.config.num_nextn_predict_layers == 1 and fp.index_bytes_per_token > 0
    slots, ctx, block = 3, 1000, 48  # (1008 tokens a slot: whole blocks)
    pool = KVPool.for_model(fp.config, tier, slots, ctx, block_size=block)
    allocated = pool.bytes_capacity()
    if tier != "f32":  # (the f32 pool also has scale planes, which it does not count: 8 B a row pair)
        assert allocated == sum(a.nbytes for p in pool.planes for a in (p.l_codes, p.l_scale, p.r_codes, p.r_scale))
    devs = [DeviceBudget("g0", "cuda", 90 * GB, slots=slots), DeviceBudget("c0", "cpu", 70 * GB, slots=slots)]
    job = plan(fp, devs, tier=tier, ctx=ctx, loaded=True, block=block, shadow_floor_bytes=200 * GB)
    engine = plan(fp, devs, tier=tier, ctx=ctx, block=block, shadow_floor_bytes=200 * GB)
    for j, e in zip(job.devices, engine.devices):
        assert j.kv_pool_bytes == allocated == slots * 1008 * 78 * fp.kv_token_bytes(tier)
        assert j.index_bytes == 0 and j.shadow_bytes == 0
        assert e.kv_pool_bytes == slots * 1008 * 79 * fp.kv_token_bytes(tier)
        assert e.index_bytes == slots * 1008 * fp.index_bytes_per_token > 0
    d, c = job.to_dict(), engine.to_dict()
    assert (d["kv_layers"], d["kv_bytes_per_token"], d["index_bytes_per_token"]) == (
        78, allocated // (slots * 1008), 0)
    assert (c["kv_layers"], c["kv_bytes_per_token"]) == (79, 79 * fp.kv_token_bytes(tier))
    # the room left goes to experts, and the longest context is the pool's
    cpu_job, cpu_engine = job.devices[1], engine.devices[1]
    assert cpu_job.free_bytes + cpu_job.pinned_bytes - (cpu_engine.free_bytes + cpu_engine.pinned_bytes) == (
        cpu_engine.kv_pool_bytes + cpu_engine.index_bytes - cpu_job.kv_pool_bytes)
    room = devs[1].capacity - fp.dense_bytes
    assert cpu_job.max_ctx["kv8"] == room // (slots * 78 * fp.kv_token_bytes("kv8")) // block * block


def test_the_jobs_plan_sets_aside_no_shadow_beside_its_device_pool():
    """A cuda device above the shadow floor: the C engine's plan sets aside its kv8 shadow of
    all 79 layers (the device copy of rows made on the host); the job's plan none, at any
    floor, since a kvfleet cuda worker's pool is on the device and takes those rows in once
    (DevicePool): its KV is counted once, as the pool allocates it. It projected a kv8 shadow
    of the pool's 78 layers on top, so GLM-5.2 at 64k tokens on an H200 pinned 380 float32
    experts of the 399 that fit, and its longest contexts left room for that shadow too."""
    from workers.weights import loaded_bytes
    fp = card("glm-5.2")
    dense32, expert32 = loaded_bytes(fp.config)
    h200 = DeviceBudget("h200/cuda0", "cuda", 141 * GB, reserve_bytes=4 * GB, slots=1)
    pool = 65_536 * 78 * 584
    for floor in (0, 32 * GB, 141 * GB):
        p = plan(fp, [h200], tier="kv8", ctx=65_536, loaded=True, shadow_floor_bytes=floor)
        [d] = p.devices
        assert (d.shadow_bytes, d.index_bytes, d.kv_pool_bytes, d.dense_bytes) == (0, 0, pool, dense32)
        assert len(d.pinned) == (137 * GB - dense32 - pool) // expert32 == 399
        assert d.pinned_bytes == 399 * expert32 and 0 <= d.free_bytes < expert32
        assert d.used_bytes == dense32 + pool + 399 * expert32
        assert d.max_ctx["kv8"] == (137 * GB - dense32) // (78 * 584) // BLOCK * BLOCK == 1_391_408
        assert (p.to_dict()["shadow_tier"], p.to_dict()["shadow_floor_bytes"]) == (None, None)
    engine = plan(fp, [h200], tier="kv8", ctx=65_536, experts="bf16")
    assert engine.devices[0].shadow_bytes == engine.devices[0].kv_pool_bytes == 65_536 * 79 * 584
    assert (engine.to_dict()["shadow_tier"], engine.to_dict()["shadow_floor_bytes"]) == ("kv8", 32 * GB)
    small = plan(fp, [DeviceBudget("g", "cuda", 141 * GB, 4 * GB)], tier="kv8", ctx=64,
                 shadow_floor_bytes=200 * GB)  # (no device reaches this floor: none counted)
    assert small.devices[0].shadow_bytes == 0 and small.to_dict()["shadow_floor_bytes"] == 200 * GB


def test_random_job_plans_count_each_devices_kv_once():
    """Random fleets planned as the job (loaded), floors from 0 (every cuda device above it):
    each device's KV, indexer and shadow bytes together are exactly what its worker's pool
    allocates (KVPool.for_model, whose planes DevicePool puts on the GPU: no other KV buffer),
    nothing beside it; the C engine's plan of the same fleet does count a shadow on a cuda
    device above the floor (the check can fail)."""
    from kvstore.pool import KVPool
    rng = np.random.default_rng(20260707)
    planned = shadowed = 0
    for case in range(200):
        fp = random_model(rng)
        devs = [DeviceBudget(f"n{case}/d{i}", str(rng.choice(["cuda", "cuda", "cpu", "metal"])),
                             int(rng.integers(1, 60) * 10**6), int(rng.integers(0, 3) * 10**6),
                             slots=int(rng.integers(1, 5))) for i in range(int(rng.integers(1, 5)))]
        tier, ctx, block = str(rng.choice(["f32", "kv8", "tq4", "polar3"])), int(rng.integers(1, 300)), int(rng.choice([1, 16, 48]))
        floor = int(rng.choice([0, rng.integers(1, 60) * 10**6]))
        try:
            p = plan(fp, devs, tier=tier, ctx=ctx, loaded=True, block=block, shadow_floor_bytes=floor)
        except PlanError:
            continue
        planned += 1
        for d in p.devices:
            pool = KVPool.for_model(fp.config, tier, d.device.slots, ctx, block_size=block)
            assert d.kv_pool_bytes + d.index_bytes + d.shadow_bytes == pool.bytes_capacity()
            assert d.used_bytes == d.dense_bytes + pool.bytes_capacity() + d.pinned_bytes <= d.device.capacity
        assert p.to_dict()["shadow_tier"] is None
        try:
            engine = plan(fp, devs, tier=tier, ctx=ctx, block=block, shadow_floor_bytes=floor, experts="bf16")
        except PlanError:  # (its shadow, indexer and MTP rows may not fit where the job's pool does)
            continue
        for d in engine.devices:
            above = d.device.kind == "cuda" and d.device.memory_bytes >= floor
            held = -(-ctx // block) * block
            assert d.shadow_bytes == (d.device.slots * held * fp.kv_bytes_per_token("kv8") if above else 0)
            shadowed += d.shadow_bytes > 0
    assert planned > 40 and shadowed > 20
