"""Saved KV per request on the tiny model (in-process runtime): a prompt that starts with a
saved cache loads that prefix instead of computing it and gives the same tokens; a shrinking
prefix truncates the file; tiers (same tier reuse, v1 upgrade, reject + clean start), also
through a slot file symlinked onto a share; a busy file; unsafe cache names; DSA refused; the
worker's row skipping against a plain loop."""
from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import replace

import numpy as np
import pytest

from cluster.config import JobConfigError, load_job_config
from cluster.jobs.generate import run_generate
from cluster.requests import parse_line
from kvstore.disk import ArrowKVFile
from kvstore.fingerprint import Fingerprint
from kvstore.slots import SlotFiles, legacy_filename, slot_filename
from runtime_helpers import make_tiny, rows_by_id, write_lines
from workers.actor import StepBatch
from workers.config import ModelConfig
from workers.model import Model
from workers.persist import skip_loaded

P = 40  # prompt tokens
C = 6  # completion tokens


@pytest.fixture
def forwarded(monkeypatch):
    """Token rows that went through Model.forward, per call."""
    calls: list[int] = []
    real = Model.forward

    def spy(self, tokens, *a, **kw):
        calls.append(len(tokens))
        return real(self, tokens, *a, **kw)
    monkeypatch.setattr(Model, "forward", spy)
    return calls


def prompt(seed: int, n: int = P) -> list[int]:
    return np.random.default_rng(seed).integers(5, 500, n).tolist()


def line(rid: str, toks, cache: str | None = "conv", max_tokens: int = C) -> str:
    obj = {"id": rid, "prompt_tokens": list(toks), "max_tokens": max_tokens}
    if cache is not None:
        obj["cache"] = cache
    return json.dumps(obj)


def run(tiny, d, lines, cache_dir=None, name="out", **kw):
    """One in-process generate job; returns (rows by id, scheduler stats)."""
    over = {"model": str(tiny), "slots": 2, "max_context": 128, "prefill_chunk": 64,
            "workers": {"runtime": "inprocess"}}
    if cache_dir is not None:
        over["kv_cache_dir"] = str(cache_dir)
    over.update(kw)
    cfg = load_job_config(env={}, overrides=over)
    d.mkdir(parents=True, exist_ok=True)
    prompts = write_lines(d / f"{name}.jsonl", lines)
    s = run_generate(cfg, prompts, d / f"{name}.parquet", progress=False)
    rows = rows_by_id(d / f"{name}.parquet")
    assert all(r["finish_reason"] == "length" for r in rows.values()), rows
    return rows, s.stats


def saved(tiny, cache_dir, name, tier, fmt="arrow"):
    """(records, file version) of a slot file."""
    fp = Fingerprint.from_config(ModelConfig.from_file(tiny / "config.json"))
    files = SlotFiles(cache_dir, fp, tier, fmt)
    with files.open(name) as f:
        recs = f.load()
        version = f.plan.file_tier.version if f.plan else None
        return recs, version, f.message


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
def test_second_run_loads_the_prompt_and_gives_the_same_tokens(tiny, tmp_path, forwarded, tier):
    toks = prompt(1)
    ref, _ = run(tiny, tmp_path / "ref", [line("a", toks, cache=None)], kv=tier)
    assert ref["a"]["cached_prompt_tokens"] == 0
    forwarded.clear()
    cache = tmp_path / "cache"
    first, st1 = run(tiny, tmp_path / "r1", [line("a", toks)], cache, kv=tier)
    assert sum(forwarded) == P + C - 1 and first["a"]["cached_prompt_tokens"] == 0
    assert st1.kv_cache == {"misses": 1, "saved_tokens": P + C - 1}
    recs, version, _ = saved(tiny, cache, "conv", tier)
    comp = first["a"]["completion_tokens"]
    assert comp == ref["a"]["completion_tokens"] and len(comp) == C
    # the last sampled token never went through the model: it has no KV yet
    assert recs.tokens.tolist() == toks + comp[:-1]
    assert version == {"f32": 1, "kv8": 2, "tq4": 3}[tier]

    path = cache / slot_filename("conv", ".arrow")
    data = path.read_bytes()
    forwarded.clear()
    second, st2 = run(tiny, tmp_path / "r2", [line("a", toks)], cache, kv=tier)
    assert second["a"]["cached_prompt_tokens"] == P - 1
    assert sum(forwarded) == 1 + (C - 1), forwarded  # last prompt token + decode tokens
    assert second["a"]["completion_tokens"] == comp
    # same tokens again: the file already holds them and is left as it was
    assert st2.kv_cache == {"hits": 1, "loaded_tokens": P - 1}
    assert path.read_bytes() == data


def test_conversation_continues_from_the_whole_saved_turn(tiny, tmp_path, forwarded):
    cache = tmp_path / "cache"
    toks = prompt(2)
    first, _ = run(tiny, tmp_path / "r1", [line("t1", toks)], cache)
    turn2 = toks + first["t1"]["completion_tokens"] + prompt(3, 10)
    ref, _ = run(tiny, tmp_path / "ref", [line("t2", turn2, cache=None)])
    forwarded.clear()
    rows, _ = run(tiny, tmp_path / "r2", [line("t2", turn2)], cache)
    assert rows["t2"]["cached_prompt_tokens"] == P + C - 1
    assert sum(forwarded) == (len(turn2) - (P + C - 1)) + (C - 1)
    assert rows["t2"]["completion_tokens"] == ref["t2"]["completion_tokens"]


@pytest.mark.parametrize("fmt", ["arrow", "coli"])
def test_a_snapshot_of_the_cache_dir_keeps_its_turn(tiny, tmp_path, fmt):
    """A `cp -al` snapshot of the cache dir, then the conversation goes on in the live dir:
    the append went into the inode both names share, so the snapshot held turn 2 as well."""
    cache, snap = tmp_path / "cache", tmp_path / "snap"
    toks = prompt(4)
    first, _ = run(tiny, tmp_path / "r1", [line("t1", toks)], cache, kv_cache_format=fmt)
    snap.mkdir()
    for name in os.listdir(cache):  # the slot file and its lock sidecar
        os.link(cache / name, snap / name)
    name = slot_filename("conv", ".arrow" if fmt == "arrow" else ".coli_kv")
    before = (snap / name).read_bytes()
    turn2 = toks + first["t1"]["completion_tokens"] + prompt(5, 10)
    rows, st = run(tiny, tmp_path / "r2", [line("t2", turn2)], cache, kv_cache_format=fmt)
    assert rows["t2"]["cached_prompt_tokens"] == P + C - 1
    assert (snap / name).read_bytes() == before and st.kv_cache["detached"] == 1
    assert saved(tiny, snap, "conv", "f32", fmt)[0].tokens.tolist() == toks + first["t1"]["completion_tokens"][:-1]
    assert saved(tiny, cache, "conv", "f32", fmt)[0].tokens.tolist() == turn2 + rows["t2"]["completion_tokens"][:-1]
    # the two files go their own ways: a run on the snapshot writes only there
    live = (cache / name).read_bytes()
    _, st = run(tiny, tmp_path / "r3", [line("t3", toks + prompt(6, 5))], snap, kv_cache_format=fmt)
    assert st.kv_cache["truncated"] == 1 and "detached" not in st.kv_cache
    assert (cache / name).read_bytes() == live


@pytest.mark.parametrize("shared", [25, 12])
def test_shrinking_prefix_truncates_the_file_then_appends(tiny, tmp_path, monkeypatch, shared):
    cache = tmp_path / "cache"
    a = prompt(4)
    run(tiny, tmp_path / "r1", [line("a", a)], cache)
    before, _, _ = saved(tiny, cache, "conv", "f32")
    b = a[:shared] + [t + 1 for t in a[shared:shared + 8]]  # diverges after `shared` tokens
    lengths = []
    real = ArrowKVFile.append

    def spy(self, recs, start=None):
        lengths.append((self.length(), start, len(recs)))
        return real(self, recs, start)
    monkeypatch.setattr(ArrowKVFile, "append", spy)
    ref, _ = run(tiny, tmp_path / "ref", [line("b", b, cache=None)])
    rows, st = run(tiny, tmp_path / "r2", [line("b", b)], cache)
    assert rows["b"]["cached_prompt_tokens"] == shared
    assert rows["b"]["completion_tokens"] == ref["b"]["completion_tokens"]
    # the file is cut back to the shared prefix and the rest appended there, at release
    assert lengths == [(P + C - 1, shared, len(b) + C - 1 - shared)]
    assert st.kv_cache["truncated"] == 1 and st.kv_cache["saved_tokens"] == lengths[0][2]
    after, _, _ = saved(tiny, cache, "conv", "f32")
    assert after.tokens.tolist() == b + rows["b"]["completion_tokens"][:-1]
    assert np.array_equal(after.l_codes[:, :shared], before.l_codes[:, :shared], equal_nan=True)


def test_prompt_shorter_than_the_saved_prefix(tiny, tmp_path, forwarded):
    cache = tmp_path / "cache"
    a = prompt(5)
    run(tiny, tmp_path / "r1", [line("a", a)], cache)
    ref, _ = run(tiny, tmp_path / "ref", [line("s", a[:15], cache=None)])
    forwarded.clear()
    rows, _ = run(tiny, tmp_path / "r2", [line("s", a[:15])], cache)
    assert rows["s"]["cached_prompt_tokens"] == 14 and sum(forwarded) == 1 + C - 1
    assert rows["s"]["completion_tokens"] == ref["s"]["completion_tokens"]
    recs, _, _ = saved(tiny, cache, "conv", "f32")
    assert recs.tokens.tolist() == a[:15] + rows["s"]["completion_tokens"][:-1]


def test_loaded_prefix_longer_than_a_prefill_chunk(tiny, tmp_path, forwarded):
    """The first chunk rides along with the attach; prefill resumes past the loaded count."""
    cache = tmp_path / "cache"
    a = prompt(6, 100)
    first, _ = run(tiny, tmp_path / "r1", [line("a", a)], cache, prefill_chunk=16)
    forwarded.clear()
    rows, _ = run(tiny, tmp_path / "r2", [line("a", a[:60] + prompt(7, 30))], cache,
                  prefill_chunk=16)
    assert rows["a"]["cached_prompt_tokens"] == 60
    assert sum(forwarded) == 30 + C - 1
    again, _ = run(tiny, tmp_path / "r3", [line("a", a)], cache, prefill_chunk=16)
    assert again["a"]["cached_prompt_tokens"] == 60  # the second run's file diverged at 60
    assert again["a"]["completion_tokens"] == first["a"]["completion_tokens"]


def test_other_tier_is_rejected_and_starts_clean(tiny, tmp_path, caplog):
    cache = tmp_path / "cache"
    toks = prompt(8)
    run(tiny, tmp_path / "r1", [line("a", toks)], cache, kv="kv8")
    ref, _ = run(tiny, tmp_path / "ref", [line("a", toks, cache=None)], kv="tq4")
    with caplog.at_level(logging.WARNING):
        rows, st = run(tiny, tmp_path / "r2", [line("a", toks)], cache, kv="tq4")
    msgs = [r.getMessage() for r in caplog.records if "written as kv8" in r.getMessage()]
    assert len(msgs) == 1 and "starting clean" in msgs[0] and "KV8=1" in msgs[0]
    assert rows["a"]["cached_prompt_tokens"] == 0
    assert rows["a"]["completion_tokens"] == ref["a"]["completion_tokens"]
    assert st.kv_cache["rejected"] == 1 and st.kv_cache["misses"] == 1
    recs, version, message = saved(tiny, cache, "conv", "tq4")  # replaced as a tq4 file
    assert version == 3 and message is None
    assert recs.tokens.tolist() == toks + rows["a"]["completion_tokens"][:-1]


def test_f32_file_is_upgraded_and_reused_under_kv8(tiny, tmp_path):
    cache = tmp_path / "cache"
    toks = prompt(9)
    run(tiny, tmp_path / "r1", [line("a", toks)], cache, kv="f32")
    rows, st = run(tiny, tmp_path / "r2", [line("a", toks)], cache, kv="kv8")
    assert rows["a"]["cached_prompt_tokens"] == P - 1 and st.kv_cache["upgraded"] == 1
    recs, version, _ = saved(tiny, cache, "conv", "kv8")
    assert version == 2 and recs.tokens.tolist() == toks + rows["a"]["completion_tokens"][:-1]


def test_rewrites_of_a_symlinked_slot_file_replace_the_share_file(tiny, tmp_path):
    """Slot files linked onto shared storage: the release's upgrade and reject rewrites
    replaced the link by a local file (the share kept the old tier). They rewrite its target."""
    cache, share = tmp_path / "cache", tmp_path / "share"
    toks = prompt(10)
    run(tiny, tmp_path / "r1", [line("a", toks)], share, kv="f32")
    name = slot_filename("conv", ".arrow")
    cache.mkdir()
    os.symlink(share / name, cache / name)
    rows, st = run(tiny, tmp_path / "r2", [line("a", toks)], cache, kv="kv8")
    assert rows["a"]["cached_prompt_tokens"] == P - 1 and st.kv_cache["upgraded"] == 1
    want = toks + rows["a"]["completion_tokens"][:-1]
    for tier, version in (("kv8", 2), ("tq4", 3)):
        if tier == "tq4":
            rows, st = run(tiny, tmp_path / "r3", [line("a", toks)], cache, kv="tq4")
            assert st.kv_cache["rejected"] == 1
            want = toks + rows["a"]["completion_tokens"][:-1]
        assert os.path.islink(cache / name) and os.readlink(cache / name) == str(share / name)
        recs, v, message = saved(tiny, share, "conv", tier)  # the share's file itself
        assert v == version and message is None and recs.tokens.tolist() == want
    for d in (share, cache):  # no temp file, no stray copy (the slot locks' sidecars stay)
        assert [n for n in os.listdir(d) if not n.endswith(".lock")] == [name]


def test_coli_format_reuse(tiny, tmp_path, forwarded):
    cache = tmp_path / "cache"
    toks = prompt(10)
    first, _ = run(tiny, tmp_path / "r1", [line("a", toks)], cache, kv="kv8",
                   kv_cache_format="coli")
    assert os.path.exists(cache / slot_filename("conv", ".coli_kv"))
    forwarded.clear()
    rows, _ = run(tiny, tmp_path / "r2", [line("a", toks)], cache, kv="kv8",
                  kv_cache_format="coli")
    assert rows["a"]["cached_prompt_tokens"] == P - 1 and sum(forwarded) == C
    assert rows["a"]["completion_tokens"] == first["a"]["completion_tokens"]


def test_a_cache_that_cannot_be_opened_runs_without_reuse(tiny, tmp_path, caplog, monkeypatch):
    """Opening the slot file raises OSError (a link onto a share where its lock file cannot
    be made, since the lock covers the link's target): the request runs from its prompt with
    the same tokens and the error is counted, instead of the attach raising out of the step."""
    cache = tmp_path / "cache"
    toks = prompt(12)
    first, _ = run(tiny, tmp_path / "r1", [line("a", toks)], cache)

    def refuse(self, name):
        raise PermissionError(13, "Permission denied", str(cache / (name + ".lock")))
    monkeypatch.setattr(SlotFiles, "open", refuse)
    with caplog.at_level(logging.ERROR):
        rows, st = run(tiny, tmp_path / "r2", [line("a", toks)], cache)
    assert rows["a"]["cached_prompt_tokens"] == 0 and st.kv_cache.get("errors") == 1
    assert rows["a"]["completion_tokens"] == first["a"]["completion_tokens"]
    assert any("opening it failed" in r.getMessage() for r in caplog.records)


def test_busy_cache_runs_without_reuse(tiny, tmp_path, caplog):
    cache = tmp_path / "cache"
    toks = prompt(11)
    first, _ = run(tiny, tmp_path / "r1", [line("a", toks)], cache)
    path = cache / slot_filename("conv", ".arrow")
    size = path.stat().st_size
    fp = Fingerprint.from_config(ModelConfig.from_file(tiny / "config.json"))
    with SlotFiles(cache, fp, "f32").open("conv"), caplog.at_level(logging.WARNING):
        rows, st = run(tiny, tmp_path / "r2", [line("a", toks)], cache)
    assert rows["a"]["cached_prompt_tokens"] == 0 and st.kv_cache == {"busy": 1}
    assert rows["a"]["completion_tokens"] == first["a"]["completion_tokens"]
    assert any("in use by another writer" in r.getMessage() for r in caplog.records)
    assert path.stat().st_size == size  # the refused writer wrote nothing
    # two requests of one job on the same cache: one holds it, the other runs without it
    rows, st = run(tiny, tmp_path / "r3", [line("x", toks), line("y", toks)], cache)
    assert sorted(r["cached_prompt_tokens"] for r in rows.values()) == [0, P - 1]
    assert st.kv_cache["busy"] == 1 and st.kv_cache["hits"] == 1
    assert rows["x"]["completion_tokens"] == rows["y"]["completion_tokens"] \
        == first["a"]["completion_tokens"]


def test_a_job_through_a_link_is_busy_while_the_shares_file_is_held(tiny, tmp_path, caplog):
    """A slot file linked onto a share, held by its own path (another job, kv convert): the
    job on the link took only the link's lock and wrote the share's file under the holder."""
    cache, share = tmp_path / "cache", tmp_path / "share"
    toks = prompt(12)
    first, _ = run(tiny, tmp_path / "r1", [line("a", toks)], share)
    name = slot_filename("conv", ".arrow")
    cache.mkdir()
    os.symlink(share / name, cache / name)
    size = (share / name).stat().st_size
    fp = Fingerprint.from_config(ModelConfig.from_file(tiny / "config.json"))
    with SlotFiles(share, fp, "f32").open("conv"), caplog.at_level(logging.WARNING):
        rows, st = run(tiny, tmp_path / "r2", [line("a", toks)], cache)
    assert rows["a"]["cached_prompt_tokens"] == 0 and st.kv_cache == {"busy": 1}
    assert rows["a"]["completion_tokens"] == first["a"]["completion_tokens"]
    assert any(f"a link to {share / name}" in r.getMessage() for r in caplog.records)
    assert (share / name).stat().st_size == size  # the refused writer wrote nothing
    rows, st = run(tiny, tmp_path / "r3", [line("a", toks)], cache)  # free: it is reused
    assert rows["a"]["cached_prompt_tokens"] == P - 1 and st.kv_cache["hits"] == 1


def test_a_legacy_file_an_older_kvfleet_still_writes_is_counted_and_warned(tiny, tmp_path,
                                                                            caplog):
    """A rolling upgrade: an older kvfleet worker on the same cache dir saves cache "User-A"
    under its old file name after this version adopted it. The job read only the new file and
    said nothing: the older worker's saves were lost to every new worker, unseen."""
    cache = tmp_path / "cache"
    toks = prompt(14)
    first, _ = run(tiny, tmp_path / "r1", [line("a", toks, cache="User-A")], cache)
    mine, _, _ = saved(tiny, cache, "User-A", "f32")
    old = cache / legacy_filename("User-A", ".arrow")
    assert not old.exists()
    fp = Fingerprint.from_config(ModelConfig.from_file(tiny / "config.json"))
    theirs = ArrowKVFile(old, fp, "f32")  # as the older kvfleet names and writes it
    theirs.load()
    theirs.append(mine.slice(0, 10))
    data = old.read_bytes()
    with caplog.at_level(logging.WARNING):
        rows, st = run(tiny, tmp_path / "r2", [line("a", toks, cache="User-A")], cache)
        assert rows["a"]["cached_prompt_tokens"] == P - 1  # from its own file
        assert st.kv_cache["legacy_ignored"] == 1 and st.kv_cache["hits"] == 1
        rows, st = run(tiny, tmp_path / "r3", [line("a", toks, cache="User-A")], cache)
        assert st.kv_cache["legacy_ignored"] == 1  # counted at every open
    warned = [r.getMessage() for r in caplog.records if "older kvfleet" in r.getMessage()]
    assert len(warned) == 1 and str(old) in warned[0]  # said once in the process
    assert str(cache / slot_filename("User-A", ".arrow")) in warned[0]
    assert old.read_bytes() == data  # left as the older kvfleet wrote it
    assert rows["a"]["completion_tokens"] == first["a"]["completion_tokens"]


def test_cache_names_stay_inside_the_dir_and_default_to_the_id(tiny, tmp_path):
    cache = tmp_path / "deep" / "cache"
    lines = [line("a", prompt(12), cache="../../evil"), line("../b", prompt(13), cache=None)]
    rows, _ = run(tiny, tmp_path / "r1", lines, cache)
    names = sorted(p.name for p in cache.iterdir() if p.suffix == ".arrow")
    assert names == sorted([slot_filename("../../evil", ".arrow"), slot_filename("../b", ".arrow")])
    assert all(n[0] != "." and "/" not in n for n in names)
    assert not list(tmp_path.glob("evil*")) and not list((tmp_path / "deep").glob("*.arrow"))
    rows2, _ = run(tiny, tmp_path / "r2", lines, cache)
    assert {k: r["cached_prompt_tokens"] for k, r in rows2.items()} == {"a": P - 1, "../b": P - 1}


def test_cache_field_validation_and_persistence_off(tiny, tmp_path, caplog):
    assert parse_line(line("a", [1, 2], cache="c"), 1).cache == "c"
    for bad in ("", 5, ["c"], "x" * 2000):
        got = parse_line(json.dumps({"id": "a", "prompt": "hi", "cache": bad}), 3)
        assert "'cache' must be a non-empty string" in got.error, bad
    with caplog.at_level(logging.WARNING):
        rows, st = run(tiny, tmp_path, [line("a", prompt(14))])  # no kv_cache_dir
    assert rows["a"]["cached_prompt_tokens"] == 0 and st.kv_cache == {}
    assert any("'cache' fields are ignored" in r.getMessage() for r in caplog.records)


def test_env_knob_and_dsa_refused(tiny, tmp_path):
    cfg = load_job_config(env={"KVFLEET_KV_CACHE_DIR": "rel/dir", "KVFLEET_KV_CACHE_FORMAT": "coli"})
    assert cfg.kv_cache_dir.is_absolute() and cfg.kv_cache_dir.parts[-2:] == ("rel", "dir")
    assert cfg.kv_cache_format == "coli" and load_job_config(env={}).kv_cache_dir is None
    glm = make_tiny(tmp_path / "glm", ("glm",))
    with pytest.raises(JobConfigError, match="does not support DSA models.*index_n_heads="):
        run(glm, tmp_path, [line("a", prompt(15))], tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_results_written_before_the_column_still_resume(tiny, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    toks = prompt(16)
    run(tiny, tmp_path, [line("a", toks, cache=None), line("b", toks, cache=None)])
    t = pq.read_table(tmp_path / "out.parquet")
    keep = pa.array([i == "a" for i in t.column("id").to_pylist()])
    old = t.drop_columns(["cached_prompt_tokens"]).filter(keep)  # a file from before the column
    # (and so from before files had a digest of their rows)
    old = old.replace_schema_metadata({k: v for k, v in t.schema.metadata.items()
                                       if k != b"kvfleet.digest"})
    pq.write_table(old, tmp_path / "old.parquet")
    write_lines(tmp_path / "old.jsonl", [line("a", toks, cache=None), line("b", toks, cache=None)])
    cfg = load_job_config(env={}, overrides={"model": str(tiny), "max_context": 128,
                                             "workers": {"runtime": "inprocess"}})
    s = run_generate(cfg, tmp_path / "old.jsonl", tmp_path / "old.parquet", progress=False)
    assert s.skipped == 1 and s.done == 1
    got = rows_by_id(tmp_path / "old.parquet")
    assert got["a"]["cached_prompt_tokens"] is None and got["b"]["cached_prompt_tokens"] == 0


# -- the worker's row skipping against a plain loop ------------------------------------------
def test_skip_loaded_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    for trial in range(50):
        keys, poss, sample = [], [], []
        lens = {}
        for k in rng.permutation(8)[:rng.integers(1, 6)].tolist():
            p = int(rng.integers(2, 40))
            lens[k] = p
            if rng.random() < 0.5:  # a prompt chunk ending the prompt (sampled last row)
                start = int(rng.integers(0, p))
                pos = list(range(start, p))
            else:  # a decode token
                pos = [p + int(rng.integers(0, 5))]
            keys += [k] * len(pos)
            poss += pos
            sample.append(len(keys) - 1)
        order = rng.permutation(len(keys))  # rows of a batch come in any order
        inv = np.argsort(order)
        keys, poss = np.array(keys)[order], np.array(poss)[order]
        sample = np.sort(inv[sample])
        loaded = {k: int(rng.integers(0, lens[k])) for k in lens if rng.random() < 0.7}
        b = StepBatch(keys=keys.astype(np.int64), tokens=rng.integers(0, 500, len(keys)).astype(np.int32),
                      positions=poss.astype(np.int32), sample_at=sample.astype(np.int32),
                      temperature=np.zeros(len(sample), np.float32), top_p=np.ones(len(sample), np.float32),
                      seed=np.zeros(len(sample), np.uint64), counter=np.zeros(len(sample), np.uint64))
        got = skip_loaded(b, loaded)
        rows = [i for i in range(len(keys)) if poss[i] >= loaded.get(int(keys[i]), 0)]
        assert got.keys.tolist() == keys[rows].tolist()
        assert got.tokens.tolist() == b.tokens[rows].tolist()
        assert got.positions.tolist() == poss[rows].tolist()
        assert got.sample_at.tolist() == [rows.index(i) for i in sample.tolist()]
    bad = replace(b, keys=np.zeros(3, np.int64), positions=np.arange(3, dtype=np.int32),
                  tokens=np.zeros(3, np.int32), sample_at=np.array([1], np.int32))
    with pytest.raises(ValueError, match="covers sampled rows"):
        skip_loaded(bad, {0: 2})


def test_a_sequence_that_computed_nothing_leaves_the_file_whole(tmp_path):
    """attach (truncating nothing) then release without a completed forward: no write."""
    from kvstore.pool import KVPool
    from kvstore.records import RecordLayout
    from workers.persist import SlotPersist
    fp = Fingerprint(3, 512, 64, 0, 0, 1000)
    files = SlotFiles(tmp_path, fp, "kv8")
    rng = np.random.default_rng(3)
    old = RecordLayout(fp, "kv8").allocate(30)
    old.tokens[:] = rng.integers(0, 1000, 30)
    for codes in (old.l_codes, old.r_codes):
        codes[:] = rng.integers(0, 0x7F, codes.shape)  # valid e4m3 codes, both signs below
        codes[:] |= rng.integers(0, 2, codes.shape).astype(np.uint8) << 7
    for scale in (old.l_scale, old.r_scale):
        scale[:] = rng.uniform(1e-3, 10, scale.shape)
    with files.open("c") as f:
        f.load()
        f.append(old)
    data = (tmp_path / "c.arrow").read_bytes()
    pool = KVPool(3, 512, 64, "kv8", n_blocks=8, block_size=16, max_slots=1)
    slot = pool.alloc_slot()
    persist = SlotPersist(files, pool.capacity_tokens)
    prompt = np.concatenate([old.tokens[:10], [7, 8, 9]]).astype(np.int32)
    b = StepBatch(keys=np.zeros(13, np.int64), tokens=prompt, positions=np.arange(13, dtype=np.int32),
                  sample_at=np.array([12], np.int32), temperature=np.zeros(1, np.float32),
                  top_p=np.ones(1, np.float32), seed=np.zeros(1, np.uint64),
                  counter=np.zeros(1, np.uint64), attach={0: ("c", prompt)})
    got, loaded = persist.attach(b, pool, {0: slot})
    assert loaded == {0: 10} and got.positions.tolist() == [10, 11, 12]
    assert got.sample_at.tolist() == [2] and pool.length(slot) == 10
    lc, ls, rc, rs = pool.read_rows(slot, 1)  # the file's codes, as stored
    assert np.array_equal(lc, old.l_codes[1, :10]) and np.array_equal(rs, old.r_scale[1, :10])
    assert persist.attach(b, pool, {0: slot})[1] == {0: 10}  # a rerun loads nothing again
    persist.release(0, pool, slot)  # the step failed: nothing computed past the prefix
    assert (tmp_path / "c.arrow").read_bytes() == data
    assert persist.drain_events() == {"hits": 1, "loaded_tokens": 10}
    with files.open("c"):  # the lock was let go
        pass


def test_expert_parallel_workers_reuse_too(tiny, tmp_path, forwarded):
    """ShardedWorkers (cluster/ep_group.py, in-process) get the same persistence."""
    cache = tmp_path / "cache"
    toks = [prompt(20), prompt(21)]
    lines = [line("a", toks[0], cache="ca"), line("b", toks[1], cache="cb")]
    ep = {"runtime": "inprocess", "experts": "sharded", "count": 2}
    first, _ = run(tiny, tmp_path / "r1", lines, cache, workers=ep)
    forwarded.clear()
    rows, st = run(tiny, tmp_path / "r2", lines, cache, workers=ep)
    assert {k: r["cached_prompt_tokens"] for k, r in rows.items()} == {"a": P - 1, "b": P - 1}
    assert {r["worker"] for r in rows.values()} == {"worker0", "worker1"}
    assert all(rows[k]["completion_tokens"] == first[k]["completion_tokens"] for k in rows)
    assert sum(forwarded) == 2 * C and st.kv_cache["hits"] == 2


def test_scheduler_counts_cache_events_in_metrics(tiny, tmp_path):
    from cluster.metrics import JobMetrics
    from cluster.scheduler import Scheduler
    from runtime_helpers import prepared
    from workers.actor import LocalGroup, Worker, WorkerSpec
    worker = Worker(WorkerSpec("w0", str(tiny), "kv8", 2, 128, kv_cache_dir=str(tmp_path)))
    item = replace(prepared(0, prompt(22), max_tokens=C), cache="m")
    for _ in range(2):
        metrics = JobMetrics(use_ray=False)
        sched = Scheduler(LocalGroup([worker]), max_context=128, prefill_chunk=64, eos_ids=(),
                          decode=lambda ids: "", tier="kv8", metrics=metrics)
        out = []
        stats = sched.run([item], out.append)
        assert {k[9:-1]: v for k, v in metrics.local.items() if k.startswith("kv_cache[")} \
            == stats.kv_cache
    assert out[0].cached_prompt_tokens == P - 1 and stats.kv_cache["hits"] == 1


def test_failed_request_leaves_the_saved_conversation_whole(tiny, tmp_path, monkeypatch):
    """b shares 20 tokens with the saved a, loads them, then its first decode step raises:
    b is an error row, and the file still holds a's 45 tokens (its release used to cut a at
    the divergence and append b's prompt)."""
    cache = tmp_path / "cache"
    a = prompt(4)
    run(tiny, tmp_path / "r1", [line("a", a)], cache)
    before, _, _ = saved(tiny, cache, "conv", "f32")
    assert len(before) == P + C - 1
    b = a[:20] + [x + 1 for x in a[20:]]
    real, calls = Model.forward, []

    def failing(self, *args, **kw):
        calls.append(1)
        if len(calls) == 2:  # b's first decode step
            raise RuntimeError("injected decode failure")
        return real(self, *args, **kw)

    monkeypatch.setattr(Model, "forward", failing)
    cfg = load_job_config(env={}, overrides={
        "model": str(tiny), "slots": 2, "max_context": 128, "prefill_chunk": 64,
        "workers": {"runtime": "inprocess"}, "kv_cache_dir": str(cache)})
    s = run_generate(cfg, write_lines(tmp_path / "b.jsonl", [line("b", b)]),
                     tmp_path / "b.parquet", progress=False)
    row = rows_by_id(tmp_path / "b.parquet")["b"]
    assert row["finish_reason"] == "error" and "injected decode failure" in row["error"]
    assert s.stats.kv_cache.get("hits") == 1 and "saved_tokens" not in s.stats.kv_cache
    after, _, _ = saved(tiny, cache, "conv", "f32")
    assert after.tokens.tolist() == before.tokens.tolist()
    np.testing.assert_array_equal(after.l_codes, before.l_codes)


def test_every_cache_event_starts_on_the_metrics_endpoint():
    """The kvfleet_kv_cache counter starts each of workers.persist.CACHE_EVENTS at 0 (else
    Prometheus's increase() misses an event's first step): every name SlotPersist counts
    must be in that list."""
    import re
    from pathlib import Path

    from workers.persist import CACHE_EVENTS
    src = (Path(__file__).resolve().parents[2] / "workers" / "persist.py").read_text()
    counted = set(re.findall(r'self\.events\["(\w+)"\]', src))
    counted |= set(re.findall(r'self\.events\["(\w+)" if \w+ else "(\w+)"\]', src)[0])
    assert counted and counted <= set(CACHE_EVENTS), sorted(counted - set(CACHE_EVENTS))


def test_a_result_comes_after_its_cache_file_is_saved_and_unlocked(tiny, tmp_path):
    """The caller that gets a Result can open the request's cache file at once (the next
    turn of the conversation, a shutdown): its KV is saved and its lock let go by the end
    of the step it finished in, at a length end or a stop string alike, while the worker's
    other sequence goes on. (The file stayed locked until the worker's next batch.)"""
    from cluster.requests import Request
    from cluster.scheduler import Prepared, Scheduler
    from workers.actor import LocalGroup, Worker, WorkerSpec
    from workers.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny)
    cache = tmp_path / "cache"
    fp = Fingerprint.from_config(ModelConfig.from_file(tiny / "config.json"))

    def item(i, max_tokens, stop=()):
        return Prepared(Request(id=f"r{i}", line=i + 1), np.asarray(prompt(30 + i), np.int32),
                        max_tokens, 0.0, 1.0, 0, stop, cache=f"c{i}")

    def generate(items, on_result, cache_dir=cache):
        group = LocalGroup([Worker(WorkerSpec("w", str(tiny), "f32", 2, 128,
                                              kv_cache_dir=str(cache_dir)))])
        Scheduler(group, max_context=128, prefill_chunk=64, eos_ids=[], decode=tok.decode,
                  tier="f32").run(items, on_result)

    free = []
    generate([item(1, 8)], free.append, tmp_path / "free")
    stop = free[0].completion[2:4]
    assert stop and free[0].completion.find(stop) < len(free[0].completion) - 2
    seen = {}

    def on_result(r):
        with SlotFiles(cache, fp, "f32").open("c" + r.id[1:]) as f:  # SlotBusyError if held
            seen[r.id] = (r.finish_reason, len(f.load().tokens))
        seen[r.id] += (P + r.completion_token_count - 1,)

    generate([item(0, 3), item(1, 8, (stop,)), item(2, 12)], on_result)
    assert seen["r0"][0] == "length" and seen["r1"][0] == "stop" and seen["r2"][0] == "length"
    for rid, (_, held, want) in seen.items():
        assert held == want, rid  # prompt + completion but its last token, saved already


def test_a_slot_file_that_is_a_fifo_is_left_alone(tiny, tmp_path):
    # (a link to /dev/null behaves the same: neither read nor replaced by a regular file)
    cache = tmp_path / "cache"
    cache.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.symlink(fifo, cache / slot_filename("conv", ".arrow"))
    hold = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # so the old code's read did not block
    try:
        os.write(hold, b"\0" * 64)
        rows, st = run(tiny, tmp_path / "r", [line("a", prompt(40))], cache)
    finally:
        os.close(hold)
    assert rows["a"]["cached_prompt_tokens"] == 0 and len(rows["a"]["completion_tokens"]) == C
    assert st.kv_cache == {"errors": 1}  # the request ran without it
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
