"""Arrow KV cache: round trips, load rules (upgrade / reject), self-heal, prefix reuse."""
from __future__ import annotations

import hashlib
import os
import stat

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


def test_reload_of_a_spoiled_file_forgets_the_old_plan(tmp_path):
    # load() again on the same object, after the header went bad: it used to keep the first
    # load's plan ("load") while the message said it started clean.
    p = tmp_path / "c.arrow"
    f = ArrowKVFile(p, FP, "kv8")
    f.append(records(FP, "kv8", 3))
    assert len(f.load()) == 3 and f.plan.action == "load"
    overwrite(p, b"hello, this is not arrow")
    assert len(f.load()) == 0 and "not an Arrow IPC stream" in f.message and f.plan is None


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


def _assert_clean_start_then_replaced(p, words):
    """load starts clean with a message naming the file; the next save replaces the file."""
    f = ArrowKVFile(p, SMALL, "kv8")
    assert len(f.load()) == 0
    assert str(p) in f.message and words in f.message and "starting clean" in f.message, f.message
    new = records(SMALL, "kv8", 4, seed=21)
    f.append(new)
    g = ArrowKVFile(p, SMALL, "kv8")
    assert same(g.load(), new) and g.message is None


def test_non_native_endian_schema_starts_clean(tmp_path):
    # Find the one-byte change of the schema message that makes it big-endian: pyarrow's
    # default reader then byte-swaps every buffer into new memory (the tokens come back
    # swapped), which load once raised as a RuntimeError.
    p = tmp_path / "c.arrow"
    parts, bounds, data = _three_batches(p, SMALL, "kv8")
    want = parts[0].tokens.byteswap()
    for i in range(8, bounds[0][1]):
        for v in (0x01, 0x08, 0x80):
            bad = bytearray(data)
            bad[i] = v
            try:
                tok = ipc.open_stream(pa.py_buffer(bytes(bad))).read_next_batch().column(0)
            except (pa.ArrowException, OSError):
                continue
            if np.array_equal(tok.to_numpy(), want):
                break
        else:
            continue
        break
    else:
        pytest.fail("no one-byte change makes the schema big-endian")
    overwrite(p, bytes(bad))
    _assert_clean_start_then_replaced(p, "not native-endian")


def test_non_utf8_column_name_starts_clean(tmp_path):
    p = tmp_path / "c.arrow"
    _, _, data = _three_batches(p, SMALL, "kv8")
    bad = bytearray(data)
    i = bad.find(b"record", bad.find(b"kvfleet.record_bytes") + 20)  # the column name
    bad[i] = 0xE0
    overwrite(p, bytes(bad))
    _assert_clean_start_then_replaced(p, "column names are not UTF-8")


def test_record_bytes_too_large_for_arrow_starts_clean(tmp_path):
    p = tmp_path / "c.arrow"
    f = ArrowKVFile(p, SMALL, "kv8")
    meta = dict(f.schema.metadata)
    meta[b"kvfleet.record_bytes"] = b"99999999999"  # pa.binary(n) would raise OverflowError
    p.write_bytes(f.schema.with_metadata(meta).serialize().to_pybytes())
    _assert_clean_start_then_replaced(p, "do not match record_bytes=99999999999")


def test_empty_or_foreign_memory_batch_is_cut(tmp_path):
    from kvstore.disk import batch_crc
    p = tmp_path / "c.arrow"
    parts, bounds, data = _three_batches(p, SMALL, "kv8")
    good = KVRecords.concat(parts[:2])
    f = ArrowKVFile(p, SMALL, "kv8")
    f.load()
    # A zero-row batch with the right start and crc (its buffers have address 0), then a
    # good batch after it: the file's good prefix ends at the empty batch.
    overwrite(p, data[:bounds[2][1]])
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        f._write_batch(fd, f.layout.allocate(0), 5)
        f._write_batch(fd, parts[2], 5)
    finally:
        os.close(fd)
    g = ArrowKVFile(p, SMALL, "kv8")
    assert same(g.load(), good) and "empty batch" in g.message and str(p) in g.message
    extra = records(SMALL, "kv8", 3, seed=22)
    g.append(extra)
    assert same(ArrowKVFile(p, SMALL, "kv8").load(), KVRecords.concat([good, extra]))
    # A compressed batch (a foreign writer) decodes into new memory, not into the file.
    rec = parts[0]
    payload = f.layout.pack(rec, with_token=False)
    width = f.layout.record_bytes - 4
    tok = pa.Array.from_buffers(pa.int32(), len(rec), [None, pa.py_buffer(rec.tokens.copy())])
    col = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(rec), [None, pa.py_buffer(payload)])
    batch = pa.RecordBatch.from_arrays([tok, col], schema=f.schema)
    meta = {"kvfleet.start": "0", "kvfleet.crc32": str(batch_crc(0, rec.tokens, payload))}
    with pa.OSFile(str(p), "wb") as sink, ipc.new_stream(
            sink, f.schema, options=ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_batch(batch, custom_metadata=meta)
    g = ArrowKVFile(p, SMALL, "kv8")
    assert len(g.load()) == 0 and "outside the file data" in g.message
    g.append(extra)
    assert same(ArrowKVFile(p, SMALL, "kv8").load(), extra)


@pytest.mark.parametrize("where", ["batch", "rename", "dir-fsync"])
def test_failed_rewrite_keeps_file_and_state(tmp_path, monkeypatch, where):
    import errno
    import kvstore.cachefile
    p = tmp_path / "c.arrow"
    old = records(SMALL, "kv8", 5, seed=31)
    f = ArrowKVFile(p, SMALL, "kv8")
    f.load()
    f.append(old)
    new = records(SMALL, "kv8", 8, seed=32)  # e.g. a compaction that runs out of space

    def enospc(*_):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")
    target = {"batch": (ArrowKVFile, "_write_batch"), "rename": (os, "replace"),
              "dir-fsync": (kvstore.cachefile, "fsync_dir")}[where]
    monkeypatch.setattr(*target, enospc)
    with pytest.raises(OSError, match="simulated"):
        f.rewrite(new)
    monkeypatch.undo()
    assert not (tmp_path / "c.arrow.tmp").exists()
    kept = new if where == "dir-fsync" else old  # after the rename the new file is the file
    assert same(ArrowKVFile(p, SMALL, "kv8").load(), kept) and f.length() == len(kept)
    more = records(SMALL, "kv8", 2, seed=33)
    assert f.append(more) == len(kept) + 2
    g = ArrowKVFile(p, SMALL, "kv8")
    assert same(g.load(), KVRecords.concat([kept, more])) and g.message is None


def two_batches(tmp_path, seed: int):
    """An Arrow kv8 cache of two batches (6 and 5 records), loaded: (path, records, file)."""
    p = tmp_path / "c.arrow"
    full = save(p, SMALL, "kv8", [records(SMALL, "kv8", 6, seed=seed),
                                  records(SMALL, "kv8", 5, seed=seed + 1)])
    f = ArrowKVFile(p, SMALL, "kv8")
    f.load()
    return p, full, f


@pytest.mark.parametrize("op", ["append", "truncate"])
def test_failed_cut_reappend_leaves_file_and_state_at_the_batch_start(tmp_path, monkeypatch, op):
    import errno
    p, full, f = two_batches(tmp_path, 41)
    new = records(SMALL, "kv8", 2, seed=43)

    def enospc(*_):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")
    monkeypatch.setattr(ArrowKVFile, "_write_batch", enospc)  # the partial tail's rewrite
    with pytest.raises(OSError, match="simulated"):
        f.append(new, start=8) if op == "append" else f.truncate(8)  # inside the 2nd batch
    monkeypatch.undo()
    assert f.length() == 6  # the 2nd batch may be torn: the object counts the 1st only
    g = ArrowKVFile(p, SMALL, "kv8")
    assert same(g.load(), full) and g.message is None  # nothing was written, nothing lost
    with pytest.raises(ValueError, match=rf"{p}: append at record start=8 leaves a gap"):
        f.append(new, start=8)  # a blind retry cannot write a batch that does not follow
    assert f.append(KVRecords.concat([full.slice(6, 8), new]), start=6) == 10
    g = ArrowKVFile(p, SMALL, "kv8")
    assert same(g.load(), KVRecords.concat([full.slice(0, 8), new])) and g.message is None
    assert [b - a for (a, _), (b, _) in zip(g._bounds, g._bounds[1:])] == [6, 4]  # no empty batch


@pytest.mark.parametrize("op", ["append", "truncate"])
def test_a_cut_inside_a_batch_on_a_full_disk_keeps_the_records_it_keeps(tmp_path, monkeypatch, op):
    # A full disk (a shared one: others take the blocks a truncate frees): writes that would
    # grow the file fail. The cut once truncated to the batch start and appended the kept
    # part after it, which failed, losing records 6..8 that it was to keep.
    import errno
    p, full, f = two_batches(tmp_path, 46)
    ino, real_write = os.stat(p).st_ino, os.write

    def full_disk(fd, data):
        st = os.fstat(fd)
        if st.st_ino == ino and os.lseek(fd, 0, os.SEEK_CUR) + len(data) > st.st_size:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", full_disk)
    if op == "truncate":
        f.truncate(8)
    else:  # a prompt that diverged at 8, and a longer sequence than the disk has room for
        with pytest.raises(OSError, match="No space left"):
            f.append(records(SMALL, "kv8", 9, seed=48), start=8)
    monkeypatch.undo()
    want = full.slice(0, 8)
    assert f.length() == 8
    g = ArrowKVFile(p, SMALL, "kv8")
    assert same(g.load(), want) and g.message is None
    more = records(SMALL, "kv8", 2, seed=49)
    assert f.append(more) == 10
    assert same(ArrowKVFile(p, SMALL, "kv8").load(), KVRecords.concat([want, more]))


def test_cut_never_appends_an_empty_tail(tmp_path):
    # The file lost its last batch behind the writer's back (a restored backup, bit rot
    # cut by another reader): the partial tail to keep is no longer there to re-append.
    p = tmp_path / "c.arrow"
    full = save(p, SMALL, "kv8", [records(SMALL, "kv8", 6, seed=44),
                                  records(SMALL, "kv8", 5, seed=45)])
    f = ArrowKVFile(p, SMALL, "kv8")
    f.load()
    data = p.read_bytes()
    overwrite(p, data[:f._bounds[1][1]])
    with pytest.raises(OSError, match=rf"{p}: records 6..8 read back short \(0\)"):
        f.truncate(8)
    g = ArrowKVFile(p, SMALL, "kv8")
    assert same(g.load(), full.slice(0, 6)) and g.message is None  # nothing cut, no 0-row batch


@pytest.mark.parametrize("field,value", [("n_layers", 2.9), ("kv_lora", 32.0), ("index_hd", False),
                                         ("rope", True), ("vocab", "50"), ("n_indexer_layers", None),
                                         ("n_layers", [2]), ("vocab", float("inf"))])
def test_fingerprint_values_must_be_ints(tmp_path, field, value):
    import json
    from kvstore.fingerprint import FIELDS, HeaderError
    p = tmp_path / "c.arrow"
    f = ArrowKVFile(p, SMALL, "kv8")
    words = dict(zip(FIELDS, SMALL.words()))
    words[field] = value  # int(value) would pass for all but the last two
    meta = dict(f.schema.metadata)
    meta[b"kvfleet.fingerprint"] = json.dumps(words).encode()
    f.__dict__["schema"] = f.schema.with_metadata(meta)  # a foreign writer's schema
    f.load()
    f.append(records(SMALL, "kv8", 3, seed=51))
    _assert_clean_start_then_replaced(p, f"{field}={value!r} must be a non-negative int")
    with pytest.raises(HeaderError, match=rf"src: impossible header numbers .*{field}="):
        Fingerprint.from_words(list(words.values()), "src")


@pytest.mark.parametrize("tag", [0x10104, 0x7F000104, 0x1000104])
def test_v3_tag_with_extra_bits_starts_clean(tmp_path, tag):
    p = tmp_path / "c.arrow"
    f = ArrowKVFile(p, FP, "tq4")
    meta = dict(f.schema.metadata)
    meta[b"kvfleet.tag"] = str(tag).encode()
    f.__dict__["schema"] = f.schema.with_metadata(meta)  # a foreign writer's schema
    f.load()
    f.append(records(FP, "tq4", 3, seed=71))
    assert read_header(str(p))[1] == tag
    g = ArrowKVFile(p, FP, "tq4")
    assert len(g.load()) == 0 and g.plan.action == "reject" and g.plan.file_tier is None
    assert "unsupported v3" in g.message and f"tag {tag:#x}" in g.message and str(p) in g.message
    new = records(FP, "tq4", 2, seed=72)
    g.append(new)
    assert read_header(str(p))[1] == 0x104 and same(ArrowKVFile(p, FP, "tq4").load(), new)


@pytest.mark.parametrize("op", ["append", "truncate", "cut", "heal"])
def test_writer_refuses_a_file_renamed_over_its_own(tmp_path, op):
    # Another writer (kv convert without the slot lock) renames a new file over the one this
    # object loaded: an append at the loaded file's end offset would land inside the new file
    # and the next load would keep nothing past that point.
    p = tmp_path / "c.arrow"
    old = save(p, SMALL, "kv8", [records(SMALL, "kv8", 4, seed=81),
                                 records(SMALL, "kv8", 3, seed=82)])
    if op == "heal":
        overwrite(p, p.read_bytes()[:-5])
    f = ArrowKVFile(p, SMALL, "kv8")
    assert len(f.load()) == (4 if op == "heal" else 7)
    theirs = records(SMALL, "kv8", 20, seed=83)
    ArrowKVFile(p, SMALL, "kv8").rewrite(theirs)
    before = digest(p)
    with pytest.raises(OSError, match=rf"{p}: replaced by another file since this writer loaded"):
        if op == "truncate":
            f.truncate(4)  # at a batch boundary: only a cut
        elif op == "cut":
            f.append(records(SMALL, "kv8", 2, seed=84), start=5)  # inside a batch: cut + re-append
        else:
            f.append(records(SMALL, "kv8", 2, seed=84))
    assert digest(p) == before
    assert same(ArrowKVFile(p, SMALL, "kv8").load(), theirs)
    f.load()  # a reload adopts the new file
    assert f.append(old.slice(0, 1)) == 21


@pytest.mark.parametrize("op", ["append", "heal"])
def test_writer_refuses_a_file_truncated_in_place_since_it_loaded(tmp_path, op):
    # Another program cuts the file in place (same inode): an append at the old end offset
    # left a hole of zeros before its batch, so the next load ended the stream at the hole
    # and the append that had returned (durable, it said) was gone. (A cut inside a batch
    # already refused: it reads the batch's records back and finds them short.)
    p = tmp_path / "c.arrow"
    old = save(p, SMALL, "kv8", [records(SMALL, "kv8", 4, seed=85),
                                 records(SMALL, "kv8", 3, seed=86)])
    if op == "heal":
        overwrite(p, p.read_bytes() + b"torn")
    f = ArrowKVFile(p, SMALL, "kv8")
    assert len(f.load()) == 7
    first_batch_end = f._bounds[1][1]
    os.truncate(p, first_batch_end + 9)  # the first batch and a few bytes of the second
    before = digest(p)
    with pytest.raises(OSError, match=rf"{p}: holds {first_batch_end + 9} bytes but this writer "
                                      rf"left \d+ there \(another program truncated it"):
        f.append(records(SMALL, "kv8", 2, seed=87))
    assert digest(p) == before
    g = ArrowKVFile(p, SMALL, "kv8")
    assert same(g.load(), old.slice(0, 4)) and "torn or corrupt tail after record 4" in g.message


def unresolved_link(tmp_path, cls, link):
    """(the cache class, a slot path that is a symlink which does not resolve, its target):
    a link to itself ("loop") or into a share that is not mounted ("dangling")."""
    from kvstore.coli import ColiKVFile
    kind = {"arrow": ArrowKVFile, "coli": ColiKVFile}[cls]
    p = tmp_path / f"c{kind.suffix}"
    target = p.name if link == "loop" else str(tmp_path / "share" / p.name)
    os.symlink(target, p)
    return kind, p, target


@pytest.mark.parametrize("cls", ["arrow", "coli"])
@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_a_symlink_that_does_not_resolve_is_an_error_not_a_new_cache(tmp_path, cls, link):
    # A slot file that is a symlink to a share that is not mounted (or a loop) looked like no
    # file at all: load started a new cache and the next save renamed a file over the link.
    kind, p, target = unresolved_link(tmp_path, cls, link)
    f = kind(p, SMALL, "kv8")
    with pytest.raises(OSError, match=rf"{p}: a symlink to '{target}' that does not resolve"):
        f.load()
    with pytest.raises(OSError, match="does not resolve"):
        f.append(records(SMALL, "kv8", 2, seed=88))
    assert os.path.islink(p) and os.readlink(p) == target
    if link == "dangling":  # the share is back: the link's file is read and appended to
        os.makedirs(tmp_path / "share")
        kind(target, SMALL, "kv8").append(records(SMALL, "kv8", 3, seed=89))
        g = kind(p, SMALL, "kv8")
        assert len(g.load()) == 3 and g.append(records(SMALL, "kv8", 1, seed=90)) == 4
        assert os.path.islink(p) and len(kind(target, SMALL, "kv8").load()) == 4


@pytest.mark.parametrize("cls", ["arrow", "coli"])
@pytest.mark.parametrize("how", ["upgrade", "reject", "not-a-cache", "rewrite"])
@pytest.mark.parametrize("chain", ["relative", "two-hops"])
def test_a_rewrite_replaces_a_symlinked_slot_files_target(tmp_path, monkeypatch, cls, how, chain):
    # Cache dirs live on shared storage with slot files linked into them. A whole-file
    # rewrite (v1 upgrade, reject and restart, a header that is not a cache, a compaction)
    # renamed its temp file over the link: the link became a local regular file and the
    # share's file kept its old records. The rewrite must replace the link's target.
    import kvstore.cachefile
    from kvstore.coli import ColiKVFile
    kind = {"arrow": ArrowKVFile, "coli": ColiKVFile}[cls]
    (tmp_path / "cache").mkdir()
    (tmp_path / "share").mkdir()
    target = tmp_path / "share" / f"real{kind.suffix}"
    p = tmp_path / "cache" / f"c{kind.suffix}"
    links = {p: os.path.join("..", "share", target.name)}
    if chain == "two-hops":  # cache/c -> share/hop (absolute) -> real (relative)
        links = {p: str(tmp_path / "share" / "hop"), tmp_path / "share" / "hop": target.name}
    file_tier, run_tier = {"upgrade": ("f32", "kv8"), "reject": ("kv8", "f32"),
                           "not-a-cache": (None, "kv8"), "rewrite": ("kv8", "kv8")}[how]
    if file_tier is None:
        target.write_bytes(b"GGUF\0\0\0\0" + bytes(200))
    else:
        src, enc = encoded(SMALL, "kv8", 6, seed=91)
        w = kind(target, SMALL, file_tier)
        w.load()
        w.append(src if file_tier == "f32" else enc)
    for link, to in links.items():
        os.symlink(to, link)

    tmps, synced = [], []
    real_write, real_sync = kind._write_new, kvstore.cachefile.fsync_dir
    monkeypatch.setattr(kind, "_write_new", lambda self, path, recs: (
        tmps.append(path), real_write(self, path, recs))[1])
    monkeypatch.setattr(kvstore.cachefile, "fsync_dir", lambda path: (
        synced.append(path), real_sync(path))[1])
    f = kind(p, SMALL, run_tier)
    got = f.load()
    new = records(SMALL, run_tier, 3, seed=92)
    if how == "rewrite":  # a compaction: the whole file replaced by exactly these records
        assert same(got, enc)
        f.rewrite(new)
        want = new
    else:
        f.append(new)
        want = KVRecords.concat([enc, new]) if how == "upgrade" else new
    monkeypatch.undo()

    assert tmps == [f"{target}.tmp"] and synced == [str(target)]
    assert sorted(os.listdir(tmp_path / "cache")) == [p.name]  # no temp file, no stray copy
    assert sorted(os.listdir(tmp_path / "share")) == sorted(
        [target.name] + (["hop"] if chain == "two-hops" else []))
    for link, to in links.items():
        assert os.path.islink(link) and os.readlink(link) == to
    assert not os.path.islink(target)
    g = kind(target, SMALL, run_tier)  # the share's file holds the rewrite, nothing lost
    assert same(g.load(), want) and g.message is None
    assert f.append(more := records(SMALL, run_tier, 2, seed=93)) == len(want) + 2
    g = kind(p, SMALL, run_tier)  # the writer goes on through the link, into the new file
    assert same(g.load(), KVRecords.concat([want, more])) and g.message is None
    assert os.path.islink(p) and same(kind(target, SMALL, run_tier).load(), g.load())


@pytest.mark.parametrize("cls", ["arrow", "coli"])
@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_a_rewrite_refuses_a_symlink_that_does_not_resolve(tmp_path, cls, link):
    # rewrite() without a load (kv convert's output) onto a link to an unmounted share put a
    # regular file in the link's place; it is the same error as load's and the link stays.
    kind, p, target = unresolved_link(tmp_path, cls, link)
    with pytest.raises(OSError, match=rf"{p}: a symlink to '{target}' that does not resolve"):
        kind(p, SMALL, "kv8").rewrite(records(SMALL, "kv8", 2, seed=94))
    assert os.path.islink(p) and os.readlink(p) == target
    assert sorted(os.listdir(tmp_path)) == [p.name]


@pytest.mark.parametrize("cls", ["arrow", "coli"])
@pytest.mark.parametrize("via", ["plain", "symlink"])
def test_a_fifo_slot_file_is_neither_read_nor_replaced(tmp_path, cls, via):
    # A slot file that is not a regular file (a FIFO; a link to /dev/null, a device) was
    # opened for reading, which blocks forever on a FIFO with no writer (and the worker's
    # step with it), or read as a cache that is not one: a clean start, whose next save
    # renamed a regular file over the FIFO / device node (as root, over /dev/null itself).
    from kvstore.coli import ColiKVFile
    kind = {"arrow": ArrowKVFile, "coli": ColiKVFile}[cls]
    fifo = tmp_path / "share" / f"c{kind.suffix}"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    p = fifo if via == "plain" else tmp_path / f"c{kind.suffix}"
    if via == "symlink":
        os.symlink(fifo, p)
    # hold both ends with junk queued, so that the old code's read returned instead of blocking
    hold = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        os.write(hold, b"\0" * 64)
        f = kind(p, SMALL, "kv8")
        with pytest.raises(OSError, match=rf"{p}: is a FIFO, not a regular file"):
            f.load()
        with pytest.raises(OSError, match="is a FIFO"):
            f.append(records(SMALL, "kv8", 2, seed=91))
        with pytest.raises(OSError, match="is a FIFO"):
            kind(p, SMALL, "kv8").rewrite(records(SMALL, "kv8", 2, seed=92))
    finally:
        os.close(hold)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(os.listdir(fifo.parent)) == [fifo.name]  # no temp file left beside it


@pytest.mark.parametrize("cls", ["arrow", "coli"])
@pytest.mark.parametrize("how", ["upgrade", "reject", "rewrite"])
@pytest.mark.parametrize("mode", [0o600, 0o664])
def test_a_whole_file_rewrite_keeps_the_files_permissions(tmp_path, cls, how, mode):
    # The rewrite made a new file with 0o644 less the umask: a cache its owner had made
    # private (the tokens are the conversation) came back world-readable from an upgrade.
    from kvstore.coli import ColiKVFile
    kind = {"arrow": ArrowKVFile, "coli": ColiKVFile}[cls]
    p = tmp_path / f"c{kind.suffix}"
    kind(p, SMALL, "f32" if how == "upgrade" else "tq4").append(
        records(SMALL, "f32" if how == "upgrade" else "tq4", 4, seed=93))
    os.chmod(p, mode)
    old = os.umask(0o022)  # (0o664 also checks that the umask does not narrow them)
    try:
        f = kind(p, SMALL, "kv8")
        new = records(SMALL, "kv8", 3, seed=94)
        if how == "rewrite":
            f.rewrite(new)
        else:
            f.load()
            assert f.plan.action == how
            f.append(new, start=0)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(p).st_mode) == mode
    got = kind(p, SMALL, "kv8")
    assert same(got.load(), new) and got.message is None
