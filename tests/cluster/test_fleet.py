"""Fleet YAML: the shipped examples load; bad files fail naming the file and field path;
`kvfleet plan --config` prints the plan."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.cli import main
from cluster.fleet import Fleet, FleetError, device_budgets
from cluster.planner import GB

FLEETS = Path(__file__).resolve().parents[2] / "configs" / "fleets"


def write(tmp_path: Path, text: str, name: str = "fleet.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_examples_load():
    h = Fleet.from_file(FLEETS / "h200x2.yaml")
    assert [d.name for d in h.devices()] == ["h200-box/cuda0", "h200-box/cuda1"]
    assert h.model_path().resolve() == (FLEETS.parent / "models" / "glm-5.2.json").resolve()
    assert (h.plan.ctx, h.plan.kv, h.plan.experts) == (131072, "kv8", "int4")
    m = Fleet.from_file(FLEETS / "mixed.yaml")
    assert {n.kind for n in m.nodes} == {"cuda", "cpu", "metal"}
    assert m.nodes[0].resources == {"cuda": 4.0} and m.nodes[2].labels == {"tier": "mac"}
    b = device_budgets(m)
    assert len(b) == 6 and b[0].memory_bytes == 80 * GB and b[0].reserve_bytes == 4 * GB and b[4].slots == 4
    assert Fleet.from_file(FLEETS / "local-auto.yaml").nodes[0].memory == "auto"


@pytest.mark.parametrize("body, where", [
    ("nodes:\n  - {name: a, kind: cuda, memory: 80}\n  - {name: b, kind: cpu, memory: lots}\n",
     "fleet.yaml: nodes.1.memory: must be a positive size in GB or 'auto', got 'lots'"),
    ("nodes:\n  - {name: a, kind: cuda, memory: -3}\n", "nodes.0.memory: must be a positive size"),
    ("nodes:\n  - {name: a, kind: tpu, memory: 80}\n", "fleet.yaml: nodes.0.kind: Input should be 'cuda', 'cpu' or 'metal' (got 'tpu')"),
    ("nodes:\n  - {name: a, kind: cuda, memory: 80, gpus: 2}\n", "fleet.yaml: nodes.0.gpus: Extra inputs are not permitted"),
    ("nodes:\n  - {name: a, kind: cuda, memory: 8, reserve_gb: 9}\n", "fleet.yaml: nodes.0: reserve_gb=9.0 leaves nothing of memory=8.0 GB"),
    ("nodes:\n  - {name: a, kind: metal, devices: 2, memory: 64}\n", "nodes.0: a metal node has one unified memory"),
    ("nodes:\n  - {name: a, kind: cuda, devices: 0, memory: 80}\n", "nodes.0.devices: Input should be greater than or equal to 1"),
    ("nodes:\n  - {name: a, kind: cuda, memory: 80}\n  - {name: a, kind: cpu, memory: 9}\n", "node names must be unique, repeated: ['a']"),
    ("plan: {kv: kv9}\nnodes:\n  - {name: a, kind: cuda, memory: 80}\n", "fleet.yaml: plan.kv: unknown KV tier 'kv9'"),
    ("plan: {experts: int3}\nnodes:\n  - {name: a, kind: cuda, memory: 80}\n", "fleet.yaml: plan.experts: unknown expert format 'int3'"),
    ("nodes: []\n", "fleet.yaml: nodes: List should have at least 1 item"),
    ("nodes:\n  - {name: 'a b', kind: cuda, memory: 80}\n", "fleet.yaml: nodes.0.name: String should match pattern"),
    ("- just a list\n", "fleet.yaml: expected a mapping with 'nodes', got list"),
    ("nodes: [\n", "fleet.yaml: not valid YAML"),
    ("plan: {shadow_floor_gb: .inf}\nnodes:\n  - {name: a, kind: cuda, memory: 80}\n",
     "fleet.yaml: plan.shadow_floor_gb: Input should be a finite number (got inf)"),
    ("plan: {shadow_floor_gb: .nan}\nnodes:\n  - {name: a, kind: cuda, memory: 80}\n",
     "fleet.yaml: plan.shadow_floor_gb: Input should be a finite number (got nan)"),
    ("nodes:\n  - {name: a, kind: cpu, memory: auto, reserve_gb: .inf}\n",
     "fleet.yaml: nodes.0.reserve_gb: Input should be a finite number (got inf)"),
    ("nodes:\n  - {name: a, kind: cuda, memory: 80}\n  - {name: b, kind: cpu, memory: 9, reserve_gb: .nan}\n",
     "fleet.yaml: nodes.1.reserve_gb: Input should be a finite number (got nan)"),
    # sizes in other units, or too big for bytes: planned as a device with room for everything,
    # or an OverflowError traceback (round(size * GB) of 1e300 GB); the bound is per kind
    # (cluster.fleet.MAX_GB), so an 80 GB card in MiB (81920) is caught too
    ("nodes:\n  - {name: a, kind: cuda, memory: 80000000000, reserve_gb: 4}\n",
     "fleet.yaml: nodes.0.memory: 8e+10 GB (node a, kind cuda) is more than a cuda device has (at most "
     "2000 GB); sizes are in GB (1e9 bytes): an 80 GB card is 80, not 81920 (MiB) or 80000000000 (bytes)"),
    ("nodes:\n  - {name: gpu-box, kind: cuda, devices: 4, memory: 81920, reserve_gb: 4}\n",
     "fleet.yaml: nodes.0.memory: 81920 GB (node gpu-box, kind cuda) is more than a cuda device has "
     "(at most 2000 GB); sizes are in GB"),
    ("nodes:\n  - {name: a, kind: cuda, memory: 80}\n  - {name: studio, kind: metal, memory: 196608}\n",
     "fleet.yaml: nodes.1.memory: 196608 GB (node studio, kind metal) is more than a metal device has "
     "(at most 2000 GB)"),
    ("nodes:\n  - {name: ram, kind: cpu, memory: 524288, reserve_gb: 32}\n",
     "fleet.yaml: nodes.0.memory: 524288 GB (node ram, kind cpu) is more than a cpu device has (at most "
     "64000 GB)"),
    ("nodes:\n  - {name: a, kind: cuda, memory: 1.0e+300}\n", "fleet.yaml: nodes.0.memory: 1e+300 GB (node a"),
    ("nodes:\n  - {name: a, kind: cpu, memory: auto, reserve_gb: 1.0e+300}\n",
     "fleet.yaml: nodes.0.reserve_gb: 1e+300 GB (node a, kind cpu) is more than a cpu device has"),
    ("nodes:\n  - {name: a, kind: cuda, memory: auto, reserve_gb: 4096}\n",
     "fleet.yaml: nodes.0.reserve_gb: 4096 GB (node a, kind cuda) is more than a cuda device has (at most "
     "2000 GB); sizes are in GB"),
    ("plan: {shadow_floor_gb: 1.0e+300}\nnodes:\n  - {name: a, kind: cuda, memory: 80}\n",
     "fleet.yaml: plan.shadow_floor_gb: 1e+300 GB is more than a cuda device has (at most 2000 GB)"),
    ("plan: {shadow_floor_gb: 32768}\nnodes:\n  - {name: a, kind: cuda, memory: 80}\n",
     "fleet.yaml: plan.shadow_floor_gb: 32768 GB is more than a cuda device has (at most 2000 GB); sizes are in GB"),
])
def test_errors_name_file_and_field(tmp_path, body, where):
    with pytest.raises(FleetError) as e:
        Fleet.from_file(write(tmp_path, body))
    assert where in str(e.value).replace(str(tmp_path) + "/", "")


def test_a_key_given_twice_is_an_error(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys: a second `nodes:` block dropped the first
    block's nodes from the plan (which fitted, on the nodes left), a second `memory:` replaced
    the first. A merge key's override (`<<: *base` then the key) is not a repeat."""
    two_blocks = write(tmp_path, "nodes:\n  - {name: gpu, kind: cuda, memory: 80}\n"
                                 "plan: {kv: kv8}\nnodes:\n  - {name: host, kind: cpu, memory: 512}\n")
    card = FLEETS.parent / "models" / "deepseek-v3.json"
    assert main(["plan", "--config", str(two_blocks), "--model-config", str(card)]) == 2
    assert capsys.readouterr().err == (f"kvfleet plan: error: {two_blocks}: line 4: key 'nodes' is given twice "
                                       "in one mapping (first on line 1); YAML would keep only the last\n")
    for body, line, key in [("nodes:\n  - name: a\n    kind: cuda\n    memory: 80\n    memory: 40\n", 5, "memory"),
                            ("nodes:\n  - {name: a, kind: cpu, memory: 8, slots: 2, slots: 4}\n", 2, "slots"),
                            ("nodes:\n  - {name: a, kind: cuda, memory: 8, resources: {g: 1, g: 2}}\n", 2, "g")]:
        with pytest.raises(FleetError, match=f"fleet.yaml: line {line}: key '{key}' is given twice"):
            Fleet.from_file(write(tmp_path, body))
    merged = Fleet.from_file(write(tmp_path, "nodes:\n  - &gpu {name: a, kind: cuda, memory: 80}\n"
                                             "  - {<<: *gpu, name: b, memory: 40}\n"))
    assert [(n.name, n.memory) for n in merged.nodes] == [("a", 80.0), ("b", 40.0)]


NODE = "nodes:\n  - {{name: a, kind: cuda, memory: 80{extra}}}\n"


@pytest.mark.parametrize("extra, top, where", [
    (", devices: true", "", "nodes.0.devices: Input should be a valid integer (got True)"),
    (", devices: '2'", "", "nodes.0.devices: Input should be a valid integer (got '2')"),
    (", slots: '2'", "", "nodes.0.slots: Input should be a valid integer (got '2')"),
    (", slots: 2.5", "", "nodes.0.slots: Input should be a valid integer (got 2.5)"),
    (", reserve_gb: true", "", "nodes.0.reserve_gb: Input should be a valid number (got True)"),
    (", reserve_gb: '4'", "", "nodes.0.reserve_gb: Input should be a valid number (got '4')"),
    (", resources: {h200: true}", "", "nodes.0.resources.h200: Input should be a valid number (got True)"),
    (", resources: {h200: '2'}", "", "nodes.0.resources.h200: Input should be a valid number (got '2')"),
    ("", "plan: {ctx: '4096'}\n", "plan.ctx: Input should be a valid integer (got '4096')"),
    ("", "plan: {ctx: true}\n", "plan.ctx: Input should be a valid integer (got True)"),
    ("", "plan: {shadow_floor_gb: false}\n", "plan.shadow_floor_gb: Input should be a valid number (got False)"),
])
def test_numbers_are_strict(tmp_path, capsys, extra, top, where):
    """pydantic's lax mode turned `devices: true` into 1 device, `slots: '2'` into 2 slots,
    `reserve_gb: true` into a 1 GB reserve and `shadow_floor_gb: false` into none: a bool or a
    string where a number belongs is an error naming the file and the field."""
    path = write(tmp_path, top + NODE.format(extra=extra))
    with pytest.raises(FleetError) as e:
        Fleet.from_file(path)
    assert str(e.value) == f"{path}: {where}"
    card = FLEETS.parent / "models" / "deepseek-v3.json"
    assert main(["plan", "--config", str(path), "--model-config", str(card)]) == 2
    assert capsys.readouterr().err == f"kvfleet plan: error: {path}: {where}\n"


def test_ints_stay_numbers_where_floats_are_expected(tmp_path):
    f = Fleet.from_file(write(tmp_path, "plan: {shadow_floor_gb: 16}\n" + NODE.format(
        extra=", reserve_gb: 3, resources: {h200: 2}, slots: 4, devices: 2")))
    n = f.nodes[0]
    assert (n.reserve_gb, n.resources, n.slots, n.devices, f.plan.shadow_floor_gb) == (3.0, {"h200": 2.0}, 4, 2, 16.0)
    assert isinstance(n.reserve_gb, float) and isinstance(f.plan.shadow_floor_gb, float)


def test_missing_file_and_frozen(tmp_path):
    with pytest.raises(FleetError, match="no such fleet file"):
        Fleet.from_file(tmp_path / "nope.yaml")
    f = Fleet.from_file(FLEETS / "h200x2.yaml")
    with pytest.raises(ValidationError, match="frozen"):
        f.nodes[0].memory = 80.0


def test_unreadable_fleet_file_is_a_fleet_error(tmp_path, capsys):
    """A --config that is a directory was an IsADirectoryError traceback."""
    with pytest.raises(FleetError, match=f"{tmp_path}: cannot read fleet file \\(Is a directory\\)"):
        Fleet.from_file(tmp_path)
    assert main(["plan", "--config", str(tmp_path)]) == 2
    assert "cannot read fleet file" in capsys.readouterr().err
    latin = tmp_path / "latin.yaml"  # (a UnicodeDecodeError traceback before)
    latin.write_bytes(b"nodes:\n  - {name: caf\xe9, kind: cpu, devices: 1, memory_gb: 8}\n")
    with pytest.raises(FleetError, match="latin.yaml: the fleet file is not UTF-8 text"):
        Fleet.from_file(latin)


def test_auto_memory_needs_a_measurement(tmp_path):
    f = Fleet.from_file(write(tmp_path, "nodes:\n  - {name: box, kind: cuda, devices: 2, memory: auto, reserve_gb: 1.5}\n"))
    with pytest.raises(FleetError, match="no free memory given for device box/cuda1"):
        device_budgets(f, {"box/cuda0": 70 * GB})
    b = device_budgets(f, {"box/cuda0": 70 * GB, "box/cuda1": 60 * GB})
    assert [(d.memory_bytes, d.capacity, d.auto) for d in b] == [(70 * GB, 68.5 * GB, True), (60 * GB, 58.5 * GB, True)]
    assert [d.memory_bytes for d in device_budgets(f, lambda spec: (spec.index + 1) * GB)] == [GB, 2 * GB]
    with pytest.raises(FleetError, match="memory 'auto' but no free memory"):
        device_budgets(f)


# --- kvfleet plan --config ---------------------------------------------------------------

def test_cli_plan_fleet_json_and_table(capsys):
    assert main(["plan", "--config", str(FLEETS / "h200x2.yaml"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [x["pinned_experts"] for x in d["devices"]] == [4033, 4033] and d["host_experts"] == 11134
    assert d["routed_experts"] == 75 * 256 and d["mtp_experts"] == 256  # (MTP layer 78: not run, not planned)
    assert d["devices"][0]["kv_pool_bytes"] == 131072 * 79 * 584
    assert sum(d["devices"][0]["pinned_per_layer"].values()) == 4033
    assert main(["plan", "--config", str(FLEETS / "mixed.yaml")]) == 0
    out = capsys.readouterr().out
    for name in ("gpu-box/cuda3", "ram-host/cpu0", "mac-studio/metal0", "served from host memory"):
        assert name in out


def test_cli_plan_auto_and_errors(tmp_path, capsys):
    fleet = write(tmp_path, "nodes:\n  - {name: box, kind: cuda, memory: auto, reserve_gb: 2}\n")
    card = FLEETS.parent / "models" / "deepseek-v3.json"
    assert main(["plan", "--config", str(fleet), "--model-config", str(card), "--free-gb", "box/cuda0=78",
                 "--ctx", "4096", "--kv", "tq4", "--experts", "fp8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["devices"][0]
    assert d["auto"] and d["budget_bytes"] == 76 * GB and d["free_bytes"] >= 0
    # errors are user errors (exit 2) that name the problem
    assert main(["plan", "--config", str(fleet), "--model-config", str(card), "--free-gb", "box/cuda0=20"]) == 2
    assert "device box/cuda0: dense weights need" in capsys.readouterr().err
    assert main(["plan", "--config", str(fleet)]) == 2
    assert "no model" in capsys.readouterr().err
    assert main(["plan", "--model-config", str(card)]) == 2
    assert "--ctx" in capsys.readouterr().err
    assert main(["plan", "--model-config", str(tmp_path / "none.json"), "--ctx", "8"]) == 2
    assert "none.json" in capsys.readouterr().err
    bad = write(tmp_path, "nodes:\n  - {name: a, kind: cuda, memory: 80}\n  - {name: b, kind: cpu, memory: lots}\n")
    assert main(["plan", "--config", str(bad)]) == 2
    assert "nodes.1.memory" in capsys.readouterr().err


def test_memory_probe(monkeypatch):
    from cluster import memory_probe
    spec = Fleet.from_dict({"nodes": [{"name": "h", "kind": "cpu", "memory": "auto"},
                                      {"name": "g", "kind": "cuda", "memory": "auto"}]}).devices()
    assert memory_probe.free_bytes(spec[0]) > 0
    monkeypatch.setattr(memory_probe.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(memory_probe.shutil, "which", lambda name: None)
    with pytest.raises(memory_probe.ProbeError, match="cuda device 0: neither cupy nor nvidia-smi"):
        memory_probe.free_bytes(spec[1])
    assert memory_probe.host_available() > 0  # /proc/meminfo without psutil


def test_auto_cpu_devices_share_the_host(tmp_path, monkeypatch, capsys):
    """The devices of one cpu node are one host's memory domains: 'auto' gives each an even
    share of its available memory. Each was given all of it, so a `devices: 3` node was
    planned (and its experts pinned) on three times the memory the host has."""
    from cluster import memory_probe
    host = 3 * 41 * GB + 2  # (not a multiple of 3: each share rounds down, never over)
    monkeypatch.setattr(memory_probe, "host_available", lambda: host)
    fleet = write(tmp_path, "nodes:\n  - {name: box, kind: cpu, devices: 3, memory: auto, reserve_gb: 1}\n"
                            "  - {name: mac, kind: metal, memory: auto, reserve_gb: 1}\n")
    b = device_budgets(Fleet.from_file(fleet), memory_probe.free_bytes)
    assert [d.memory_bytes for d in b] == [41 * GB] * 3 + [host]  # (metal: one device, the whole)
    assert sum(d.memory_bytes for d in b[:3]) <= host
    card = FLEETS.parent / "models" / "kimi-k2.json"
    assert main(["plan", "--config", str(fleet), "--model-config", str(card), "--ctx", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [x["budget_bytes"] for x in d["devices"]] == [40 * GB] * 3 + [host - GB]
    assert sum(x["dense_bytes"] + x["kv_pool_bytes"] + x["pinned_expert_bytes"] for x in d["devices"][:3]) <= host


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-5"])
def test_cli_plan_free_gb_must_be_finite(tmp_path, capsys, value):
    fleet = write(tmp_path, "nodes:\n  - {name: box, kind: cpu, memory: auto, reserve_gb: 2}\n")
    card = FLEETS.parent / "models" / "glm-5.2.json"
    assert main(["plan", "--config", str(fleet), "--model-config", str(card), "--free-gb", f"box/cpu0={value}"]) == 2
    assert f"--free-gb 'box/cpu0={value}': GB must be a finite number >= 0" in capsys.readouterr().err


def test_cli_plan_free_gb_must_be_a_size_in_gb(tmp_path, capsys):
    """A --free-gb in bytes or MiB planned a device with room for everything; 1e300 was an
    OverflowError. The bound is the device's kind's (cluster.fleet.MAX_GB)."""
    fleet = write(tmp_path, "nodes:\n  - {name: box, kind: cpu, memory: auto, reserve_gb: 2}\n"
                            "  - {name: gpu, kind: cuda, memory: auto, reserve_gb: 4}\n")
    card = FLEETS.parent / "models" / "glm-5.2.json"
    for spec, want in (("box/cpu0=120000000000", "1.2e+11 GB is more than a cpu device has (at most 64000 GB)"),
                       ("box/cpu0=1e300", "1e+300 GB is more than a cpu device has (at most 64000 GB)"),
                       ("gpu/cuda0=143360", "143360 GB is more than a cuda device has (at most 2000 GB)")):
        assert main(["plan", "--config", str(fleet), "--model-config", str(card), "--free-gb", spec,
                     "--free-gb", "gpu/cuda0=140", "--free-gb", spec]) == 2
        err = capsys.readouterr().err
        assert f"--free-gb '{spec}': {want}; sizes are in GB (1e9 bytes)" in err, err
    assert main(["plan", "--config", str(fleet), "--model-config", str(card), "--free-gb", "box/cpu0=64000",
                 "--free-gb", "gpu/cuda0=2000"]) == 0


def test_the_largest_devices_there_are_plan(tmp_path):
    """The per-kind bounds leave room for every real device: a 288 GB GPU, a 512 GB Mac, a
    24 TB host, and each kind's bound itself."""
    fleet = Fleet.from_file(write(tmp_path, "nodes:\n  - {name: b300, kind: cuda, memory: 288}\n"
                                            "  - {name: mac, kind: metal, memory: 512, reserve_gb: 24}\n"
                                            "  - {name: mac2, kind: metal, memory: auto, reserve_gb: 2000}\n"
                                            "  - {name: flex, kind: cpu, memory: 24000}\n"
                                            "  - {name: edge, kind: cuda, memory: 2000, reserve_gb: 1999.5}\n"
                                            "  - {name: huge, kind: cpu, memory: 64000}\n"))
    assert [n.memory for n in fleet.nodes] == [288, 512, "auto", 24000, 2000, 64000]


def test_cli_plan_free_gb_must_name_an_auto_device(tmp_path, capsys):
    """A --free-gb for a device the fleet has not (or whose memory is not 'auto') was ignored:
    the device was measured on this machine instead."""
    fleet = write(tmp_path, "nodes:\n  - {name: box, kind: cpu, memory: auto, reserve_gb: 2}\n"
                            "  - {name: big, kind: cpu, memory: 512}\n")
    card = FLEETS.parent / "models" / "glm-5.2.json"
    for spec in ("box/cpu1=2000", "big/cpu0=100"):
        assert main(["plan", "--config", str(fleet), "--model-config", str(card), "--free-gb", spec]) == 2
        assert (f"--free-gb {spec.partition('=')[0]}: not an 'auto' device of {fleet}; its 'auto' "
                "devices: ['box/cpu0']") in capsys.readouterr().err


def test_failed_probe_names_fleet_file_and_device(tmp_path, monkeypatch, capsys):
    """A probe that fails on this machine is a FleetError (kvfleet plan: exit 2) naming the
    file, the field and the fleet's device, not only the local GPU index."""
    from cluster import memory_probe
    monkeypatch.setattr(memory_probe.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(memory_probe.shutil, "which", lambda name: None)
    fleet = write(tmp_path, "nodes:\n  - {name: host, kind: cpu, memory: 64}\n"
                            "  - {name: gpu-box, kind: cuda, devices: 2, memory: auto}\n")
    f = Fleet.from_file(fleet)
    with pytest.raises(FleetError) as e:
        device_budgets(f, lambda spec: {"gpu-box/cuda0": 70 * GB}.get(spec.name) or memory_probe.free_bytes(spec))
    assert str(e.value) == (f"{fleet}: nodes.1.memory: 'auto', but the free memory of device gpu-box/cuda1 could "
                            "not be measured on this machine (cuda device 1: neither cupy nor nvidia-smi is "
                            "available to read free memory); give memory in GB")
    card = FLEETS.parent / "models" / "deepseek-v3.json"
    assert main(["plan", "--config", str(fleet), "--model-config", str(card)]) == 2
    err = capsys.readouterr().err
    assert f"kvfleet plan: error: {fleet}: nodes.1.memory:" in err and "device gpu-box/cuda0" in err


def test_nvidia_smi_id_follows_cuda_visible_devices():
    """nvidia-smi numbers GPUs physically; CuPy (and the fleet's device index) logically."""
    from cluster import memory_probe
    assert memory_probe.smi_id(1, {}) == "1"
    assert memory_probe.smi_id(0, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "2"
    assert memory_probe.smi_id(1, {"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}) == "GPU-bb"
    with pytest.raises(memory_probe.ProbeError, match="CUDA_VISIBLE_DEVICES='3' shows 1 device"):
        memory_probe.smi_id(1, {"CUDA_VISIBLE_DEVICES": "3"})
    # set but empty: CUDA sees no device (nvidia-smi read physical GPU 0 for it)
    with pytest.raises(memory_probe.ProbeError, match="CUDA_VISIBLE_DEVICES='' shows 0 device"):
        memory_probe.smi_id(0, {"CUDA_VISIBLE_DEVICES": ""})


def test_auto_free_memory_below_the_reserve_says_so(tmp_path, capsys):
    """An 'auto' device whose free memory is below its reserve_gb was an error about its dense
    weights and a negative budget ('budget is -1.00 GB (3.00 GB - reserve 4.00 GB)')."""
    fleet = write(tmp_path, "nodes:\n  - {name: box, kind: cpu, memory: auto, reserve_gb: 4}\n")
    card = FLEETS.parent / "models" / "glm-5.2.json"
    assert main(["plan", "--config", str(fleet), "--model-config", str(card), "--free-gb", "box/cpu0=3.5"]) == 2
    assert capsys.readouterr().err == ("kvfleet plan: error: device box/cpu0: its free memory ('auto') 3.50 GB "
                                       "is no more than its reserve 4.00 GB: nothing is left for weights or KV (lower its "
                                       "node's reserve_gb, or free memory there)\n")
