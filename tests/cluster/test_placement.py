"""Placement of a fleet job: planned exactly as `kvfleet plan` plans the fleet, a failed
memory probe is a user error naming the fleet file and device, a set job `slots` overrides
the nodes' and a set `workers.count` must agree with the fleet, and a relative
`workers.fleet` resolves against the repo root like `model`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.config import REPO_ROOT, JobConfigError, load_job_config
from cluster.placement import fleet_placements

CARD = REPO_ROOT / "configs" / "models" / "glm-5.2.json"
SHARDED = REPO_ROOT / "configs" / "sharded.yaml"

# 1M tokens of kv8 on one H200: the C engine's plan fits it only without its fp8 shadow (48 GB
# at this ctx); the job's plan sets none aside (its pool is the rows' one device copy)
BIG_CTX = ("model: {card}\nplan: {{ctx: 1048576, kv: kv8, experts: int4{floor}}}\n"
           "nodes:\n  - {{name: h200, kind: cuda, memory: 141, reserve_gb: 4, slots: 1}}\n")
# three devices of the shipped kvfleet-mini's size, with slots of their own
THREE = ("nodes:\n  - {name: host, kind: cpu, devices: 2, memory: 4, reserve_gb: 1, slots: 3}\n"
         "  - {name: mac, kind: metal, memory: 4, reserve_gb: 1, slots: 1}\n")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def job(env=None, **over):
    return load_job_config(env=env or {}, overrides=over)


def test_job_plans_the_fleet_as_kvfleet_plan_does(tmp_path, capsys):
    """The job plans its fleet as `kvfleet plan --as-job` does (plan_fleet): the same fleet
    fits in both or in neither, with the same room for experts: on a cuda device the float32
    dense weights its CuPy worker uploads (twice the bf16 the plain plan counts, as the C
    engine stores them, whose output is unchanged). This began as a check that the fleet's
    plan.shadow_floor_gb reached the job (it was ignored there, so a fleet could fit the
    job and not the plan); the job's plan now sets aside no shadow at all (a cuda worker's
    pool is on its GPU and takes host rows in once), so the floor decides the plain plan
    alone: with the default floor that plan is refused for its shadow, the job's fits."""
    from cluster.footprint import Footprint
    from workers.weights import loaded_bytes
    off = write(tmp_path / "off.yaml", BIG_CTX.format(card=CARD, floor=", shadow_floor_gb: 1000"))
    assert main(["plan", "--config", str(off), "--json", "--as-job"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert d["shadow_bytes"] == 0
    [p] = fleet_placements(job(model=str(CARD), kv="kv8", max_context=1048576, workers={"fleet": str(off)}))
    assert p.expert_room == d["free_bytes"] + d["pinned_expert_bytes"] > 0
    fp = Footprint.from_file(CARD)
    dense32, expert32 = loaded_bytes(fp.config)
    assert d["dense_bytes"] == dense32 and d["pinned_expert_bytes"] == d["pinned_experts"] * expert32
    assert main(["plan", "--config", str(off), "--json", "--experts", "bf16"]) == 0
    c = json.loads(capsys.readouterr().out)["devices"][0]  # the C engine's sizes: bf16
    assert c["dense_bytes"] == fp.dense_bytes and c["pinned_expert_bytes"] == c["pinned_experts"] * fp.expert_bytes("bf16")
    assert c["pinned_experts"] > d["pinned_experts"] and expert32 == 2 * fp.expert_bytes("bf16")
    assert main(["plan", "--config", str(off), "--as-job", "--experts", "int4"]) == 2
    assert "--as-job plans the bf16 experts" in capsys.readouterr().err
    on = write(tmp_path / "on.yaml", BIG_CTX.format(card=CARD, floor=""))  # the 32 GB default floor
    assert main(["plan", "--config", str(on)]) == 2
    assert "shadow 48.38 GB" in capsys.readouterr().err  # (the C engine's: 79 layers of kv8)
    assert main(["plan", "--config", str(on), "--json", "--as-job"]) == 0
    job_plan = json.loads(capsys.readouterr().out)
    assert job_plan["devices"][0] == d and job_plan["shadow_tier"] is None  # the floor changes nothing
    [q] = fleet_placements(job(model=str(CARD), kv="kv8", max_context=1048576, workers={"fleet": str(on)}))
    assert q.expert_room == p.expert_room == 137 * 10**9 - dense32 - 1048576 * 78 * 584


def test_h200_job_pins_experts_in_the_room_no_shadow_takes(capsys):
    """GLM-5.2 on the shipped 2 x H200 fleet at 64k tokens of kv8: the job's plan set aside a
    2.99 GB fp8 shadow per GPU beside the KV pool, though a cuda worker's pool is on the GPU
    and holds the rows made on the host (uploaded once, when written: kvstore/device_pool.py),
    so the same rows were counted twice and each worker pinned 380 float32 experts where 399
    fit. The placement's rooms and its split pin those 399; `kvfleet plan --as-job` prints
    them and says no shadow was counted, the plain plan keeps the C engine's shadow."""
    from cluster.footprint import Footprint
    from cluster.placement import split_owners
    from workers.weights import loaded_bytes
    fleet = REPO_ROOT / "configs" / "fleets" / "h200x2.yaml"
    fp = Footprint.from_file(CARD)
    dense32, expert32 = loaded_bytes(fp.config)
    pool = 65536 * 78 * 584  # KVPool.for_model: 78 layers of 584-byte kv8 rows
    cfg = job(model=str(CARD), kv="kv8", max_context=65536, workers={"fleet": str(fleet), "experts": "sharded"})
    pl = fleet_placements(cfg)
    assert [p.expert_room for p in pl] == [137 * 10**9 - dense32 - pool] * 2
    split = split_owners(cfg, [p.expert_room for p in pl], [p.kind for p in pl], True)
    pins = [sum(int(v.sum()) for v in per.values()) for per in split.pinned]
    assert pins == [399, 399] and 399 * expert32 <= pl[0].expert_room < 400 * expert32
    assert main(["plan", "--config", str(fleet), "--ctx", "65536", "--as-job", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["shadow_tier"], d["shadow_floor_bytes"]) == (None, None)
    for v in d["devices"]:
        assert (v["shadow_bytes"], v["kv_pool_bytes"], v["pinned_experts"]) == (0, pool, 399)
        assert v["pinned_expert_bytes"] == 399 * expert32 and v["free_bytes"] == pl[0].expert_room - 399 * expert32
    assert main(["plan", "--config", str(fleet), "--ctx", "65536", "--as-job"]) == 0
    assert "shadow: none (a kvfleet cuda worker's KV pool is on the GPU" in capsys.readouterr().out
    assert main(["plan", "--config", str(fleet), "--ctx", "65536", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)  # the C engine's: its kv8 shadow over 79 layers
    assert (c["shadow_tier"], c["shadow_floor_bytes"]) == ("kv8", 32 * 10**9)
    assert [v["shadow_bytes"] for v in c["devices"]] == [65536 * 79 * 584] * 2
    assert main(["plan", "--config", str(fleet), "--ctx", "65536"]) == 0
    assert "shadow: kv8 rows of 79 layers on cuda devices of at least 32.0 GB" in capsys.readouterr().out


def test_failed_probe_is_a_usage_error_naming_fleet_and_device(tmp_path, monkeypatch, capsys):
    from cluster import memory_probe

    def no_gpu(index):
        raise memory_probe.ProbeError(f"cuda device {index}: nvidia-smi failed (9): NVML not found")
    monkeypatch.setattr(memory_probe, "_cuda_free", no_gpu)
    fleet = write(tmp_path / "auto.yaml", "nodes:\n"
                  "  - {name: host, kind: cpu, memory: 4, reserve_gb: 1, slots: 2}\n"
                  "  - {name: gpu-box, kind: cuda, devices: 2, memory: auto, reserve_gb: 2}\n")
    with pytest.raises(JobConfigError) as e:
        fleet_placements(job(workers={"fleet": str(fleet), "experts": "sharded"}))
    for part in (f"workers.fleet: {fleet}: nodes.1.memory", "gpu-box/cuda0",
                 "cuda device 0: nvidia-smi failed (9): NVML not found", "give memory in GB"):
        assert part in str(e.value)
    cfg = write(tmp_path / "job.yaml", f"workers: {{fleet: {fleet}, experts: sharded, runtime: inprocess}}\n")
    prompts = write(tmp_path / "p.jsonl", '{"id": "a", "prompt": "hi", "max_tokens": 2}\n')
    assert main(["generate", "--config", str(cfg), "--prompts", str(prompts),
                 "--out", str(tmp_path / "out.parquet")]) == 2  # no traceback: exit 2, one line
    err = capsys.readouterr().err
    assert "kvfleet generate: error: workers.fleet:" in err and "gpu-box/cuda0" in err and str(fleet) in err


def test_job_slots_override_the_nodes(tmp_path):
    fleet = write(tmp_path / "f.yaml", THREE)
    w = {"fleet": str(fleet)}
    slots = lambda cfg: [p.spec.slots for p in fleet_placements(cfg)]  # noqa: E731
    assert slots(job(workers=w)) == [3, 3, 1]  # slots left unset: each node's own
    assert slots(job(slots=5, workers=w)) == [5, 5, 5]  # --slots
    assert slots(job(env={"KVFLEET_SLOTS": "7"}, workers=w)) == [7, 7, 7]
    yaml_job = write(tmp_path / "job.yaml", f"slots: 6\nworkers: {{fleet: {fleet}}}\n")
    six = fleet_placements(load_job_config(yaml_job, env={}))
    assert [p.spec.slots for p in six] == [6, 6, 6]
    # the plan behind expert_room counts the overriding slots: more KV, less room for experts
    assert all(a.expert_room > b.expert_room for a, b in zip(fleet_placements(job(slots=1, workers=w)), six))
    with pytest.raises(JobConfigError, match=r"slots=4000 overrides every node's slots"):
        fleet_placements(job(slots=4000, workers=w))  # no longer fits: the error says why


def test_workers_count_must_match_the_fleet(tmp_path):
    w = {"fleet": str(write(tmp_path / "f.yaml", THREE))}
    assert len(fleet_placements(job(workers=w))) == 3  # count left unset
    assert len(fleet_placements(job(workers={**w, "count": 3}))) == 3  # agrees with the fleet
    for make in (lambda: job(workers={**w, "count": 5}), lambda: job(env={"KVFLEET_WORKERS": "1"}, workers=w)):
        with pytest.raises(JobConfigError, match=r"workers.count=\d but workers.fleet .*f.yaml gives one "
                                                 r"worker per device, 3 in all"):
            fleet_placements(make())


def test_relative_fleet_resolves_against_the_repo_root(tmp_path, monkeypatch):
    """The shipped configs/sharded.yaml (fleet: configs/fleets/local-sharded.yaml) from any cwd."""
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "mine.yaml", "nodes:\n  - {name: a, kind: cpu, memory: 4}\n")  # in the cwd only
    cfg = load_job_config(SHARDED, env={})
    assert not cfg.workers.fleet.is_absolute() and cfg.model == REPO_ROOT / "models" / "kvfleet-mini"
    pl = fleet_placements(cfg)
    assert [p.spec.name for p in pl] == ["host/cpu0", "host/cpu1", "mac/metal0"]
    with pytest.raises(JobConfigError, match=f"workers.fleet: {REPO_ROOT / 'mine.yaml'}: no such fleet file"):
        fleet_placements(job(workers={"fleet": "mine.yaml"}))


def test_int4_fleet_job_and_printed_plan_split_experts_alike(tmp_path, capsys, caplog):
    """A fleet with plan.experts: int4 whose even share of kvfleet-mini's 24 experts (8 a
    device) fits two small devices in int4 but not in bf16. The job loads bf16 experts
    (workers/weights.py reads no int4 ones) and split them as bf16, all 24 on the roomy
    device, while the plan it was pointed at planned int4 and printed 8 / 8 / 8. The job now
    plans as bf16 too, the plan command it is pointed at says --experts bf16 and prints
    the job's split, and the int4 plan warns that it is not what the job runs."""
    from cluster.footprint import Footprint
    from cluster.placement import split_owners
    mini = REPO_ROOT / "models" / "kvfleet-mini"
    fp = Footprint.from_file(mini / "config.json")
    eb16, eb4 = fp.expert_bytes("bf16"), fp.expert_bytes("int4")
    fixed = fp.dense_bytes + 64 * fp.run_kv_bytes_per_token("f32")  # (the job's pool: planner.token_bytes)
    small, big = 8 * eb4 + eb4 // 2, 100 * eb16  # 8 int4 experts fit small, 8 bf16 do not
    assert 8 * eb4 < small < 8 * eb16
    node = "  - {{name: {n}, kind: cpu, memory: {gb!r}, reserve_gb: 0, slots: 1}}\n"
    fleet = write(tmp_path / "int4.yaml", "plan: {ctx: 64, kv: f32, experts: int4}\nnodes:\n" + "".join(
        node.format(n=n, gb=(fixed + room) / 1e9) for n, room in (("a", small), ("b", small), ("c", big))))
    cfg = job(model=str(mini), kv="f32", max_context=64, workers={"fleet": str(fleet), "experts": "sharded"})
    pl = fleet_placements(cfg)
    assert [abs(p.expert_room - r) < 1000 for p, r in zip(pl, (small, small, big))] == [True] * 3
    owners = split_owners(cfg, [p.expert_room for p in pl], [p.kind for p in pl], True).owners[0]
    job_counts = [{str(l): int((o == w).sum()) for l, o in owners.items()} for w in range(3)]
    assert [sum(c.values()) for c in job_counts] == [0, 0, 24]  # bf16: 8 do not fit a or b
    # the plan command that `kvfleet plan --config JOB` points at prints exactly that split
    job_yaml = write(tmp_path / "job.yaml", f"model: {mini}\nkv: f32\nmax_context: 64\n"
                     f"workers: {{fleet: {fleet}, experts: sharded}}\n")
    assert main(["plan", "--config", str(job_yaml)]) == 2
    hint = capsys.readouterr().err.split("kvfleet plan ", 1)[1].split()
    assert "--experts" in hint and hint[hint.index("--experts") + 1] == "bf16"
    assert main(["plan", *hint, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["expert_format"] == "bf16" and not d["experts_even"]
    # (budgets sized on bf16: every device is told its float32 weights exceed it, nothing else)
    assert [w.split(":")[0] for w in d["warnings"]] == ["device a/cpu0", "device b/cpu0", "device c/cpu0"]
    assert all("holds its weights as float32" in w for w in d["warnings"])
    assert [v["pinned_per_layer"] for v in d["devices"]] == job_counts
    # the fleet's own int4 plan deals 8 / 8 / 8 and says that the job does otherwise
    assert main(["plan", "--config", str(fleet), "--model-config", str(mini / "config.json"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["experts_even"] and [v["pinned_experts"] for v in d["devices"]] == [8, 8, 8]
    assert any("kvfleet generate loads bf16 experts" in w and "--experts bf16" in w for w in d["warnings"])
    assert "plan.experts=int4, but the job loads bf16 experts" in caplog.text  # the job's log says so


@pytest.mark.parametrize("block_size, kv", [(1500, "f32"), (7, "kv8"), (16, "tq4"), (2048, "kv8")])
def test_job_plan_counts_the_kv_pool_its_workers_allocate(tmp_path, capsys, block_size, kv):
    """A worker's pool gives each slot ceil(max_context / block_size) blocks of the job's
    block_size (KVPool.for_model, which DevicePool and MLXKVPool inherit): 2048 tokens in
    1500-token blocks hold 3000 a slot. The job's plan counted whole 16-token blocks (2048),
    so its room for experts took the difference from memory the pool had already used, and
    a device with room for 2048 tokens a slot was planned although its pool does not fit."""
    from cluster.footprint import Footprint
    from kvstore.pool import KVPool
    mini = REPO_ROOT / "models" / "kvfleet-mini"
    fp = Footprint.from_file(mini / "config.json")
    ctx, slots = 2048, 3
    pool = KVPool.for_model(fp.config, kv, slots, ctx, block_size=block_size)
    real = pool.bytes_capacity()
    assert real == slots * -(-ctx // block_size) * block_size * fp.kv_bytes_per_token(kv)
    room = 5 * fp.expert_bytes("bf16") + 12345
    gb = (fp.dense_bytes + real + room) / 1e9
    fleet = write(tmp_path / "f.yaml", f"nodes:\n  - {{name: h, kind: cpu, memory: {gb!r}, reserve_gb: 0, "
                                       f"slots: {slots}}}\n")
    cfg = job(model=str(mini), kv=kv, max_context=ctx, block_size=block_size, workers={"fleet": str(fleet)})
    [p] = fleet_placements(cfg)
    assert p.expert_room == round(gb * 1e9) - fp.dense_bytes - real
    # `kvfleet plan --config JOB` points at the plan the job makes, with its block size
    job_yaml = write(tmp_path / "job.yaml", f"model: {mini}\nkv: {kv}\nmax_context: {ctx}\n"
                     f"block_size: {block_size}\nworkers: {{fleet: {fleet}}}\n")
    assert main(["plan", "--config", str(job_yaml)]) == 2
    hint = capsys.readouterr().err.split("kvfleet plan ", 1)[1].split()
    assert main(["plan", *hint, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["devices"][0]["kv_pool_bytes"] == real and d["block_size"] == block_size
    assert d["devices"][0]["free_bytes"] + d["devices"][0]["pinned_expert_bytes"] == p.expert_room
    assert all(n % block_size == 0 for n in d["devices"][0]["max_ctx"].values())
    if real > slots * ctx * fp.kv_bytes_per_token(kv):  # a budget for ctx tokens a slot, not the pool
        gb = (fp.dense_bytes + slots * ctx * fp.kv_bytes_per_token(kv)) / 1e9
        write(fleet, f"nodes:\n  - {{name: h, kind: cpu, memory: {gb!r}, reserve_gb: 0, slots: {slots}}}\n")
        with pytest.raises(JobConfigError, match="exceed its budget"):
            fleet_placements(cfg)


def test_fleet_job_with_a_tier_its_pools_refuse_is_a_config_error(tmp_path):
    """A model whose kv_lora_rank is not a power of two cannot use tq4 / polar (the pool
    refuses to rotate its rows): the job's plan fitted them anyway, and every worker then
    failed building its pool. The job now stops first, naming its `kv` and the model."""
    raw = json.loads((REPO_ROOT / "models" / "kvfleet-mini" / "config.json").read_text())
    model = tmp_path / "wide"
    model.mkdir()
    write(model / "config.json", json.dumps({**raw, "kv_lora_rank": 384}))
    w = {"fleet": str(write(tmp_path / "f.yaml", THREE))}
    for kv in ("tq4", "polar3"):
        with pytest.raises(JobConfigError, match=f"kv={kv} .*: tier {kv} rotates rows.*kv_lora_rank 384"):
            fleet_placements(job(model=str(model), kv=kv, max_context=64, workers=w))
    assert len(fleet_placements(job(model=str(model), kv="kv8", max_context=64, workers=w))) == 3
