"""JobConfig: YAML < environment < flags, frozen, errors naming file/variable and field path."""
from __future__ import annotations

import logging

import pydantic
import pytest

from cluster.cli import UsageError
from cluster.config import (DEFAULT_MODEL, REPO_ROOT, JobConfig, JobConfigError, env_overrides,
                            load_job_config, resolve_model)
from cluster.commands.generate import DEFAULT_CONFIG


def write(tmp_path, text, name="job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_and_shipped_config_agree():
    d = load_job_config(env={})
    assert d.model == DEFAULT_MODEL == REPO_ROOT / "models" / "kvfleet-mini"
    assert d.kv == "f32" and d.sampling.temperature == 0.0
    shipped = load_job_config(DEFAULT_CONFIG, env={})
    assert shipped == d  # configs/generate.yaml spells out the defaults


def test_yaml_fields_and_frozen(tmp_path):
    p = write(tmp_path, "kv: tq4\nslots: 3\nmax_context: 512\nsampling: {max_tokens: 5, top_p: 0.5}\n"
                        "workers: {count: 2, resources: {cpu_worker: 1}, label_selector: {kind: cpu}}\n"
                        "model: models/other\n")
    c = load_job_config(p, env={})
    assert (c.kv, c.slots, c.max_context, c.sampling.max_tokens, c.sampling.top_p) == \
        ("tq4", 3, 512, 5, 0.5)
    assert c.workers.resources == {"cpu_worker": 1.0} and c.workers.label_selector == {"kind": "cpu"}
    assert c.model == REPO_ROOT / "models" / "other" and c.model_ref() == "models/other"
    assert resolve_model(c.model_ref()) == c.model
    with pytest.raises(pydantic.ValidationError):
        c.slots = 4
    with pytest.raises(pydantic.ValidationError):
        c.sampling.seed = 1


@pytest.mark.parametrize("text, where", [
    ("slotz: 3\n", "slotz"),
    ("sampling: {temperature: hot}\n", "sampling.temperature"),
    ("sampling: {temperature: 1.0e+300}\n", "sampling.temperature"),  # (inf as float32)
    ("sampling: {max_tokens: 0}\n", "sampling.max_tokens"),
    ("workers: {count: 1, extra: 2}\n", "workers.extra"),
    ("kv: tq3\n", "kv"),
    ("max_context: 8\nblock_size: 16\n", "max_context"),
])
def test_errors_name_file_and_field(tmp_path, text, where):
    p = write(tmp_path, text)
    with pytest.raises(JobConfigError) as e:
        load_job_config(p, env={})
    msg = str(e.value)
    assert str(p) in msg and where in msg, msg
    assert isinstance(e.value, UsageError)


def test_bad_files(tmp_path):
    with pytest.raises(JobConfigError, match="cannot read config"):
        load_job_config(tmp_path / "missing.yaml", env={})
    latin = tmp_path / "latin.yaml"  # (a UnicodeDecodeError traceback before)
    latin.write_bytes(b"model: models/caf\xe9\n")
    with pytest.raises(JobConfigError, match="latin.yaml: not UTF-8 text"):
        load_job_config(latin, env={})
    with pytest.raises(JobConfigError, match="not valid YAML"):
        load_job_config(write(tmp_path, "kv: [f32\n"), env={})
    with pytest.raises(JobConfigError, match="top level must be a mapping"):
        load_job_config(write(tmp_path, "- 1\n- 2\n"), env={})


@pytest.mark.parametrize("text, line, key, first", [
    ("model: m\nslots: 8\nslots: 9\n", 3, "slots", 2),  # (it ran with 9)
    ("sampling:\n  temperature: 0.5\n  seed: 1\n  temperature: 0\n", 4, "temperature", 2),
    ("workers: {count: 2, count: 1}\n", 1, "count", 1),
    ("sampling: {seed: 1}\nkv: kv8\nsampling: {seed: 2}\n", 3, "sampling", 1),
])
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, capsys, text, line, key, first):
    """PyYAML keeps the last of two equal keys, silently."""
    path = write(tmp_path, text)
    said = (f"{path}: line {line}: key '{key}' is given twice in one mapping (first on line "
            f"{first}); YAML would keep only the last")
    with pytest.raises(JobConfigError) as e:
        load_job_config(path, env={})
    assert str(e.value) == said
    from cluster.cli import main
    assert main(["generate", "--prompts", str(path), "--out", str(tmp_path / "o.parquet"),
                 "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"kvfleet generate: error: {said}\n"
    assert not (tmp_path / "o.parquet").exists()


def test_a_merge_keys_override_is_not_a_repeat(tmp_path):
    path = write(tmp_path, "workers: {<<: {count: 2, num_cpus: 2}, count: 3}\n")
    assert load_job_config(path, env={}).workers.count == 3


@pytest.mark.parametrize("env, tier", [
    ({"KV8": "1"}, "kv8"),
    ({"KV8": "0"}, "f32"),
    ({"KV_TQ": "4"}, "tq4"),
    ({"KV_TQ": "3", "KV_TQ_POLAR": "1"}, "polar3"),
    ({"KV_TQ": "4", "KV_TQ_POLAR": "1"}, "polar4"),
    ({"KV_TQ": "4", "KV8": "1"}, "tq4"),
    ({"KV8": "false"}, "f32"),  # (the switches read off as KVFLEET_METAL does)
    ({"KV8": "Off"}, "f32"),
    ({"KV8": "no"}, "f32"),
    ({"KV8": "true"}, "kv8"),
    ({"KV_TQ": "4", "KV_TQ_POLAR": "false"}, "tq4"),
    ({"KV_TQ": "4", "KV_TQ_POLAR": "yes"}, "polar4"),
])
def test_env_tier_knobs(env, tier):
    assert load_job_config(env=env).kv == tier


def test_env_tq_wins_over_kv8_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert env_overrides({"KV_TQ": "4", "KV8": "1"}) == {"kv": "tq4"}
    assert "KV_TQ wins" in caplog.text


@pytest.mark.parametrize("env, match", [
    ({"KV_TQ": "3"}, "tq3"),  # tq only exists with 4 bits
    ({"KV_TQ": "7", "KV_TQ_POLAR": "1"}, "polar7"),
    ({"KV_TQ": "four"}, "KV_TQ='four'"),
    ({"KV_TQ_POLAR": "1"}, "KV_TQ_POLAR"),
    ({"KVFLEET_SLOTS": "many"}, "KVFLEET_SLOTS='many'"),
    ({"KVFLEET_SLOTS": "0"}, r"slots \(from KVFLEET_SLOTS\)"),
    ({"KVFLEET_SEED": "-1"}, r"sampling.seed \(from KVFLEET_SEED\)"),
    ({"KVFLEET_TEMPERATURE": "inf"}, r"sampling.temperature \(from KVFLEET_TEMPERATURE\)"),
    ({"KVFLEET_TEMPERATURE": "1e39"}, r"sampling.temperature \(from KVFLEET_TEMPERATURE\)"),
    ({"KVFLEET_TOP_P": "2"}, r"sampling.top_p \(from KVFLEET_TOP_P\)"),
])
def test_env_errors_name_the_variable(env, match):
    with pytest.raises(JobConfigError, match=match):
        load_job_config(env=env)


def test_precedence_yaml_env_flags(tmp_path):
    p = write(tmp_path, "kv: kv8\nslots: 2\nsampling: {max_tokens: 7, seed: 9}\n")
    env = {"KVFLEET_SLOTS": "5", "KV_TQ": "4", "KVFLEET_MAX_TOKENS": "11"}
    c = load_job_config(p, env=env)
    assert (c.kv, c.slots, c.sampling.max_tokens, c.sampling.seed) == ("tq4", 5, 11, 9)
    c = load_job_config(p, env=env, overrides={"slots": 1, "sampling": {"max_tokens": 3}})
    assert (c.kv, c.slots, c.sampling.max_tokens, c.sampling.seed) == ("tq4", 1, 3, 9)
    with pytest.raises(JobConfigError, match=r"flags: slots \(from flags\)"):
        load_job_config(p, env=env, overrides={"slots": 0})
    # a bad variable that a flag overrides is no error; the flag's value is the one checked
    c = load_job_config(p, env={"KVFLEET_SLOTS": "0"}, overrides={"slots": 4})
    assert c.slots == 4


def test_model_from_env_is_relative_to_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = load_job_config(env={"KVFLEET_MODEL": "m"})
    assert c.model == tmp_path.resolve() / "m" and c.model_ref() == str(tmp_path.resolve() / "m")


def test_jobconfig_direct_construction_forbids_extras():
    with pytest.raises(pydantic.ValidationError):
        JobConfig(slot=3)


def test_ray_resource_amounts_must_be_finite_and_not_negative(tmp_path):
    """Ray refuses a negative custom resource only when the actor is made, deep in a job;
    the job config and the fleet file name the key instead (both took any float before)."""
    from cluster.fleet import Fleet, FleetError
    for bad, why in (({"gpu_node": -1}, "greater than or equal to 0"), ({"x": float("inf")}, "finite")):
        with pytest.raises(JobConfigError, match=f"workers.resources.{next(iter(bad))}.*{why}"):
            load_job_config(env={}, overrides={"workers": {"resources": bad}})
    assert load_job_config(env={}, overrides={"workers": {"resources": {"x": 0.5}}}).workers.resources == {"x": 0.5}
    f = tmp_path / "f.yaml"
    f.write_text("nodes:\n  - {name: box, kind: cpu, devices: 1, memory: 8, resources: {h200: -2}}\n")
    with pytest.raises(FleetError, match="nodes.0.resources.h200"):
        Fleet.from_file(f)


def test_top_p_default_from_the_environment():
    """KVFLEET_TOP_P sets sampling.top_p, as KVFLEET_TEMPERATURE and KVFLEET_SEED set theirs
    (there was no variable for it)."""
    assert load_job_config(env={"KVFLEET_TOP_P": "0.9"}).sampling.top_p == 0.9


def test_step_timeout_from_yaml_env_and_flags(tmp_path):
    """workers.step_timeout_s (RayGroup's hung-step limit) could only be set on RayGroup's
    constructor: no job config, variable or flag reached it. 0 or null: no timeout."""
    assert load_job_config(env={}).workers.step_timeout_s == 600.0
    p = write(tmp_path, "workers: {step_timeout_s: 90}\n")
    assert load_job_config(p, env={}).workers.step_timeout_s == 90.0
    for off in ("0", "null", "0.0"):
        q = write(tmp_path, f"workers: {{step_timeout_s: {off}}}\n", name="off.yaml")
        assert load_job_config(q, env={}).workers.step_timeout_s is None
    assert load_job_config(p, env={"KVFLEET_STEP_TIMEOUT_S": "1800"}).workers.step_timeout_s == 1800.0
    assert load_job_config(p, env={"KVFLEET_STEP_TIMEOUT_S": "0"}).workers.step_timeout_s is None
    c = load_job_config(p, env={"KVFLEET_STEP_TIMEOUT_S": "1800"},
                        overrides={"workers": {"step_timeout_s": 45}})
    assert c.workers.step_timeout_s == 45.0


@pytest.mark.parametrize("text", ["-1", ".inf", ".nan", "yes", "soon"])
def test_step_timeout_errors_name_the_field(tmp_path, text):
    """A negative, infinite or NaN timeout, or a switch (YAML `yes` is True, which read as a
    1 s limit: every step 'hung'), is refused naming the file and the field."""
    p = write(tmp_path, f"workers: {{step_timeout_s: {text}}}\n")
    with pytest.raises(JobConfigError) as e:
        load_job_config(p, env={})
    msg = str(e.value)
    assert str(p) in msg and "workers.step_timeout_s" in msg, msg


@pytest.mark.parametrize("value, match", [
    ("-5", r"workers.step_timeout_s \(from KVFLEET_STEP_TIMEOUT_S\): .*positive number of seconds"),
    ("nan", r"workers.step_timeout_s \(from KVFLEET_STEP_TIMEOUT_S\)"),
    ("ten", r"KVFLEET_STEP_TIMEOUT_S='ten' \(field workers.step_timeout_s\)"),
])
def test_step_timeout_env_errors_name_the_variable(value, match):
    with pytest.raises(JobConfigError, match=match):
        load_job_config(env={"KVFLEET_STEP_TIMEOUT_S": value})


def test_generate_hands_the_step_timeout_to_ray_group(monkeypatch):
    """The job built RayGroup(placements): always the constructor's default timeout."""
    from cluster.jobs import generate
    got = {}

    class FakeGroup:
        def __init__(self, placements, **kw):
            got.update(kw, n=len(placements))

        def close(self):
            pass

    monkeypatch.setattr(generate, "RayGroup", FakeGroup)
    monkeypatch.setattr(generate, "connect_ray", lambda cfg, placements: False)
    for value, want in ((75, 75.0), (0, None)):
        cfg = load_job_config(env={}, overrides={"workers": {"count": 2, "step_timeout_s": value}})
        generate._start_workers(cfg)
        assert got == {"step_timeout_s": want, "n": 2}


def test_a_step_timeout_that_the_workers_do_not_use_is_said_to_be_unused(monkeypatch, caplog):
    """Expert-parallel / fleet groups and in-process workers have no step timeout: a
    workers.step_timeout_s set for them did nothing, silently (the default says nothing)."""
    import cluster.ep_group
    from cluster.jobs import generate
    monkeypatch.setattr(cluster.ep_group, "start_group", lambda cfg: ("group", None))
    monkeypatch.setattr(generate, "worker_placements", lambda cfg: [])
    for workers in ({"experts": "sharded"}, {"runtime": "inprocess"}):
        for value, warned in ((90, True), (0, True), (600, False)):
            caplog.clear()
            cfg = load_job_config(env={}, overrides={"workers": dict(workers, step_timeout_s=value)})
            with caplog.at_level("WARNING", logger="cluster.jobs.generate"):
                generate._start_workers(cfg)
            assert ("workers.step_timeout_s" in caplog.text and "is not used" in caplog.text) \
                == warned, (workers, value, caplog.text)


FLEETS = sorted((REPO_ROOT / "configs" / "fleets").glob("*.yaml"))


@pytest.mark.parametrize("fleet", FLEETS, ids=[f.name for f in FLEETS])
def test_a_fleet_file_given_as_the_job_config_is_named_as_one(fleet, tmp_path):
    """`kvfleet generate --config configs/fleets/h200x2.yaml` said only 'plan: Extra inputs
    are not permitted (got {...}); nodes: Extra inputs are not permitted (got [...])'."""
    with pytest.raises(JobConfigError) as e:
        load_job_config(fleet, env={})
    msg = str(e.value)
    assert msg.startswith(f"{fleet}: is a fleet file") and "Extra inputs" not in msg, msg
    # the job config line to write: workers.fleet resolves against the repo root
    rel = fleet.relative_to(REPO_ROOT)
    assert f"`workers: {{fleet: {rel}}}`" in msg and f"kvfleet plan --config {fleet}" in msg
    cfg = load_job_config(write(tmp_path, f"workers: {{fleet: {rel}}}\n"), env={})
    assert REPO_ROOT / cfg.workers.fleet == fleet
    # a fleet file outside the repo is named by its absolute path
    outside = write(tmp_path, fleet.read_text(), name="my fleet.yaml")
    with pytest.raises(JobConfigError) as e:
        load_job_config(outside, env={})
    assert f"`workers: {{fleet: {outside}}}`" in str(e.value)


@pytest.mark.parametrize("text", [
    "kv: kv8\nnodes:\n  - {name: a, kind: cpu, memory: 4}\n",  # a job config with a stray `nodes`
    "model: ../models/x\nplan: {ctx: 4096}\nnode:\n  - {name: a, kind: cpu, memory: 4}\n",
])
def test_a_job_config_with_fleet_fields_keeps_its_own_error(tmp_path, text):
    """Only a file with `nodes` and no job-only field is taken for a fleet file: a job config
    with a stray `nodes` (or a fleet file without any) is told which keys are wrong."""
    with pytest.raises(JobConfigError) as e:
        load_job_config(write(tmp_path, text), env={})
    assert "is a fleet file" not in str(e.value) and "Extra inputs" in str(e.value)


def test_every_kvfleet_variable_the_source_names_is_known():
    """KNOWN_ENV cannot go stale: a KVFLEET_ name anywhere in the code (a read, a message)
    is in it; a name ending in `_` (KVFLEET_CUDA_*) is a prefix of known ones."""
    import re
    from cluster.config import KNOWN_ENV
    found = {}
    for pkg in ("cluster", "workers", "kvstore", "kernels", "scripts", "models"):
        for path in (REPO_ROOT / pkg).rglob("*.py"):
            for name in re.findall(r"KVFLEET_[A-Z0-9_]+", path.read_text(encoding="utf-8")):
                found.setdefault(name, path)
    assert len(found) >= 20
    for name, path in sorted(found.items()):
        if name.endswith("_"):
            assert any(k.startswith(name) for k in KNOWN_ENV), (name, path)
        else:
            assert name in KNOWN_ENV, f"{name} (in {path}) is not in cluster/config.py KNOWN_ENV"


def test_a_misspelt_kvfleet_variable_warns_once_with_the_close_name(tmp_path, monkeypatch,
                                                                    caplog, capsys):
    """KVFLEET_SLOT=16 was ignored silently; now a warning, not a refusal."""
    from cluster.cli import main
    for k in [k for k in __import__("os").environ if k.startswith("KVFLEET_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVFLEET_SLOT", "16")
    monkeypatch.setenv("KVFLEET_TEMPERATUR", "0.5")
    monkeypatch.setenv("KVFLEET_ZZZZZZZZZZZZZZZZ", "1")
    monkeypatch.setenv("KVFLEET_SLOTS", "2")  # (known: no warning)
    monkeypatch.setenv("KVFLEET_CUDA_PDL", "0")
    caplog.set_level(logging.WARNING)
    assert main(["generate", "--prompts", str(tmp_path / "none.jsonl"),
                 "--out", str(tmp_path / "o.parquet")]) == 2  # (no such file: after the check)
    said = sorted(r.getMessage() for r in caplog.records if "not a kvfleet variable" in r.getMessage())
    assert said == [
        "environment KVFLEET_SLOT is not a kvfleet variable: it is ignored (did you mean KVFLEET_SLOTS?)",
        "environment KVFLEET_TEMPERATUR is not a kvfleet variable: it is ignored (did you mean "
        "KVFLEET_TEMPERATURE?)",
        "environment KVFLEET_ZZZZZZZZZZZZZZZZ is not a kvfleet variable: it is ignored"]
    assert "--prompts" in capsys.readouterr().err
