"""Arrow KV cache: round trips, load rules (upgrade / reject), self-heal, prefix reuse."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from diskdata import FP, FP_DSA, SMALL, encoded, overwrite, records, same
from kvstore.disk import ArrowKVFile, read_header
from kvstore.fingerprint import Fingerprint
from kvstore.prefix import common_prefix, reuse_prefix
from kvstore.records import KVRecords, RecordLayout

TIERS = ["f32", "kv8", "tq4", "polar3"]


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def save(path, fp, tier, parts: list[KVRecords]) -> KVRecords:
    f = ArrowKVFile(path, fp, tier)
    assert len(f.load()) == 0
    for p in parts:
        f.append(p)
    return KVRecords.concat(parts)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fp", [FP, FP_DSA], ids=["mla", "dsa"])
def test_round_trip_byte_identical(tmp_path, tier, fp):
    parts = [records(fp, tier, n, seed=i) for i, n in enumerate([5, 1, 17])]
    want = save(tmp_path / "c.arrow", fp, tier, parts)
    f = ArrowKVFile(tmp_path / "c.arrow", fp, tier)
    got = f.load()
    assert f.message is None and same(got, want)
    assert len(f._bounds) == 4  # one batch per append
    # The file is a plain Arrow stream: pyarrow reads the same tokens.
    with open(tmp_path / "c.arrow", "rb") as fh:
        table = ipc.open_stream(fh.read()).read_all()
    np.testing.assert_array_equal(table.column("token").to_numpy(), want.tokens)


@pytest.mark.parametrize("tier", ["kv8", "tq4", "polar4"])
def test_encoded_rows_survive_save_load(tmp_path, tier):
    _, enc = encoded(FP, tier, 40, seed=3)
    save(tmp_path / "c.arrow", FP, tier, [enc.slice(0, 25), enc.slice(25, 40)])
    assert same(ArrowKVFile(tmp_path / "c.arrow", FP, tier).load(), enc)


@pytest.mark.parametrize("tier", ["kv8", "tq4", "polar2"])
def test_v1_upgrade_left_intact_until_save(tmp_path, tier):
    from kernels.cpu.codecs import encode_rows
    p = tmp_path / "c.arrow"
    src, enc = encoded(FP, tier, 12, seed=5)
    save(p, FP, "f32", [src])
    before = digest(p)
    f = ArrowKVFile(p, FP, tier)
    got = f.load()
    assert same(got, enc) and "rewritten" in f.message and "v1" in f.message
    assert digest(p) == before and read_header(str(p))[0] == 1  # untouched by load
    f.truncate(10)  # the prefix shrank before the first save: still untouched
    assert digest(p) == before
    more = records(FP, tier, 3, seed=9)
    assert f.append(more) == 13
    assert read_header(str(p))[:2] == (2 if tier == "kv8" else 3, f.tier.tag)
    g = ArrowKVFile(p, FP, tier)
    assert same(g.load(), KVRecords.concat([enc.slice(0, 10), more])) and g.message is None
    lc, _ = encode_rows(tier, src.l_codes[:, :10])
    np.testing.assert_array_equal(g.load().l_codes[:, :10], lc)


@pytest.mark.parametrize("file_tier,run_tier,words", [
    ("kv8", "f32", ["kv8 (v2)", "KV8=1"]),
    ("kv8", "tq4", ["kv8 (v2)", "KV8=1"]),
    ("tq4", "kv8", ["codec 1 rotated int4, 4-bit", "KV_TQ=4"]),
    ("tq4", "f32", ["codec 1 rotated int4, 4-bit"]),
    ("tq4", "polar3", ["codec 1 rotated int4, 4-bit", "codec 0 PolarQuant, 3-bit"]),
    ("polar5", "polar4", ["PolarQuant, 5-bit", "PolarQuant, 4-bit", "KV_TQ=5 KV_TQ_POLAR=1"]),
])
def test_reject_other_tier(tmp_path, file_tier, run_tier, words):
    p = tmp_path / "c.arrow"
    save(p, FP, file_tier, [records(FP, file_tier, 4)])
    before = digest(p)
    f = ArrowKVFile(p, FP, run_tier)
    assert len(f.load()) == 0
    assert all(w in f.message for w in words), f.message
    assert str(p) in f.message and "starting clean" in f.message
    assert digest(p) == before  # not destroyed until a new save replaces it
    new = records(FP, run_tier, 2, seed=1)
    f.append(new)
    assert same(ArrowKVFile(p, FP, run_tier).load(), new)


@pytest.mark.parametrize("field", ["n_layers", "kv_lora", "rope", "index_hd", "vocab"])
def test_reject_other_model(tmp_path, field):
    p = tmp_path / "c.arrow"
    save(p, FP_DSA, "kv8", [records(FP_DSA, "kv8", 3)])
    other = dict(zip(["n_layers", "kv_lora", "rope", "index_hd", "n_indexer_layers", "vocab"],
                     FP_DSA.words()))
    other[field] = other[field] * 2
    f = ArrowKVFile(p, Fingerprint(**other), "kv8")
    assert len(f.load()) == 0
    assert "different model" in f.message and f"{field}=" in f.message


def test_not_a_cache_starts_clean(tmp_path):
    p = tmp_path / "c.arrow"
    p.write_bytes(b"hello, this is not arrow")
    f = ArrowKVFile(p, FP, "kv8")
    assert len(f.load()) == 0 and "not an Arrow IPC stream" in f.message
    with pa.OSFile(str(p), "wb") as sink, ipc.new_stream(sink, pa.schema([("x", pa.int32())])) as w:
        w.write_batch(pa.record_batch([pa.array([1, 2], pa.int32())], names=["x"]))
    assert len(f.load()) == 0 and "not a kvfleet KV cache" in f.message
    f.append(records(FP, "kv8", 2))
    assert len(ArrowKVFile(p, FP, "kv8").load()) == 2


def _three_batches(p, fp, tier, last=2):
    parts = [records(fp, tier, n, seed=i) for i, n in enumerate([3, 2, last])]
    save(p, fp, tier, parts)
    f = ArrowKVFile(p, fp, tier)
    f.load()
    return parts, f._bounds, open(p, "rb").read()


@pytest.mark.parametrize("fp,tier", [(SMALL, "f32"), (FP, "kv8")], ids=["small-f32", "glm-kv8"])
def test_self_heal_truncated_at_every_byte(tmp_path, fp, tier):
    p = tmp_path / "c.arrow"
    parts, bounds, data = _three_batches(p, fp, tier, last=1)
    good = KVRecords.concat(parts[:2])
    extra = records(fp, tier, 1, seed=99)
    for cut in range(bounds[2][1], bounds[3][1]):
        overwrite(p, data[:cut])
        f = ArrowKVFile(p, fp, tier)
        got = f.load()
        assert same(got, good), cut
        assert (f.message is None) == (cut == bounds[2][1]), (cut, f.message)
        if cut % 29 and cut != bounds[2][1] + 1:
            continue  # heal-then-append on a sample of the offsets (and the first ones)
        f.append(extra)
        assert os.path.getsize(p) == f._bounds[-1][1]  # the torn bytes are gone
        assert same(ArrowKVFile(p, fp, tier).load(), KVRecords.concat([good, extra])), cut


def test_flipped_byte_is_cut_never_misread(tmp_path):
    p = tmp_path / "c.arrow"
    parts, bounds, data = _three_batches(p, SMALL, "kv8")
    full, prefix = KVRecords.concat(parts), KVRecords.concat(parts[:2])
    caught = 0
    for i in range(bounds[2][1], bounds[3][1]):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        overwrite(p, bytes(bad))
        got = ArrowKVFile(p, SMALL, "kv8").load()
        assert same(got, full) or same(got, prefix), i  # padding flips change nothing
        caught += same(got, prefix)
    body = len(parts[2]) * (RecordLayout(SMALL, "kv8").record_bytes)
    assert caught >= body  # every data byte is covered by the checksum
    # A flip in the middle batch drops it and everything after it.
    bad = bytearray(data)
    bad[bounds[2][1] - 20] ^= 0xFF
    overwrite(p, bytes(bad))
    assert same(ArrowKVFile(p, SMALL, "kv8").load(), parts[0])


def test_flipped_schema_byte_never_misreads(tmp_path):
    p = tmp_path / "c.arrow"
    parts, bounds, data = _three_batches(p, SMALL, "kv8")
    full = KVRecords.concat(parts)
    for i in range(0, bounds[0][1], 3):
        bad = bytearray(data)
        bad[i] ^= 0x21
        overwrite(p, bytes(bad))
        got = ArrowKVFile(p, SMALL, "kv8").load()
        assert len(got) == 0 or same(got, full), i


def test_truncate_inside_batch_and_gap(tmp_path):
    p = tmp_path / "c.arrow"
    parts = [records(FP, "tq4", 6, seed=1), records(FP, "tq4", 6, seed=2)]
    full = save(p, FP, "tq4", parts)
    f = ArrowKVFile(p, FP, "tq4")
    f.load()
    f.truncate(8)
    assert same(ArrowKVFile(p, FP, "tq4").load(), full.slice(0, 8))
    tail = records(FP, "tq4", 3, seed=7)
    f.append(tail, start=4)  # prefix shrank further: cut inside the first batch
    assert same(ArrowKVFile(p, FP, "tq4").load(), KVRecords.concat([full.slice(0, 4), tail]))
    with pytest.raises(ValueError, match="gap"):
        f.append(tail, start=9)
    with pytest.raises(ValueError, match="KVRecords.l_codes"):
        f.append(records(FP, "kv8", 1))


def test_common_prefix():
    a = np.array([5, 6, 7, 8], np.int32)
    assert common_prefix(a, a) == 4
    assert common_prefix(a, a[:2]) == 2
    assert common_prefix(a, np.array([5, 6, 0, 8])) == 2
    assert common_prefix(a, np.array([], np.int32)) == 0
    assert common_prefix(a[:0], a) == 0


def test_reuse_prefix_truncates_when_prefix_shrinks(tmp_path):
    p = tmp_path / "c.arrow"
    full = save(p, FP, "kv8", [records(FP, "kv8", 10, seed=4)])
    prompt = np.concatenate([full.tokens[:6], [999, 998]]).astype(np.int32)
    f = ArrowKVFile(p, FP, "kv8")
    got = reuse_prefix(f, prompt)
    assert same(got, full.slice(0, 6)) and f.length() == 6
    assert same(ArrowKVFile(p, FP, "kv8").load(), full.slice(0, 6))
    # The whole prompt saved: keep the last token to recompute its logits.
    f2 = ArrowKVFile(p, FP, "kv8")
    assert len(reuse_prefix(f2, full.tokens[:6])) == 5
    assert len(reuse_prefix(ArrowKVFile(p, FP, "kv8"), full.tokens[:5], keep_last=0)) == 5


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4"])
def test_pool_round_trip_through_disk(tmp_path, tier):
    from diskdata import hostile_rows
    from kvstore.pool import KVPool
    from kvstore.prefix import from_pool, to_pool
    rng = np.random.default_rng(11)
    pool = KVPool(3, 512, 64, tier, n_blocks=12, block_size=16, max_slots=3)
    a, b = pool.alloc_slot(), pool.alloc_slot()
    n = 37
    pos = np.arange(n)
    for layer in range(3):
        pool.write(layer, np.full(n, a), pos, hostile_rows(rng, (n, 512)), hostile_rows(rng, (n, 64)))
    tokens = rng.integers(0, 1000, n).astype(np.int32)
    f = ArrowKVFile(tmp_path / "s.arrow", FP, tier)
    f.load()
    f.append(from_pool(pool, a, tokens, 0, 20))
    f.append(from_pool(pool, a, tokens, start=20))
    prompt = np.concatenate([tokens[:30], [1, 2, 3]]).astype(np.int32)
    recs = reuse_prefix(ArrowKVFile(tmp_path / "s.arrow", FP, tier), prompt)
    assert len(recs) == 30 and np.array_equal(recs.tokens, tokens[:30])
    to_pool(pool, b, recs)
    assert pool.length(b) == 30
    for layer in range(3):
        for x, y in zip(pool.read_rows(a, layer, 0, 30), pool.read_rows(b, layer)):
            assert x.tobytes() == y.tobytes()
    with pytest.raises(ValueError, match="do not fit"):
        to_pool(KVPool(3, 512, 64, "polar3", n_blocks=4), 0, recs)


def test_schema_record_bytes_must_match_the_fingerprint(tmp_path):
    from kvstore.disk import make_schema
    p = tmp_path / "c.arrow"
    schema = make_schema(2, 1, "kv8", FP, 1000)  # kv8 records of FP take 1756 bytes
    p.write_bytes(schema.serialize().to_pybytes())  # a stream holding only the schema
    f = ArrowKVFile(p, FP, "kv8")
    assert len(f.load()) == 0 and "kvfleet.record_bytes=1000" in f.message
