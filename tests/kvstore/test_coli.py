"""The C engine's .coli_kv: byte layout against a hand-written reference, load rules, sanitize."""
from __future__ import annotations

import hashlib
import os
import struct

import numpy as np
import pytest

from diskdata import FP, FP_DSA, SMALL, encoded, overwrite, records, same
from kernels.tiers import get_tier
from kvstore.coli import ColiKVFile, read_header
from kvstore.fingerprint import Fingerprint, HeaderError
from kvstore.records import KVRecords, RecordLayout

MAGIC = {1: b"COLIKV1\0", 2: b"COLIKV2\0", 3: b"COLIKV3\0"}


def reference_bytes(fp: Fingerprint, tier, recs: KVRecords, nrec: int | None = None) -> bytes:
    """The layout as the C engine's writer spells it, one field at a time (test oracle)."""
    t = get_tier(tier)
    out = [MAGIC[t.version], struct.pack("<8i", *fp.words(), len(recs) if nrec is None else nrec, t.tag)]
    for j in range(len(recs)):
        out.append(struct.pack("<i", int(recs.tokens[j])))
        for i in range(fp.n_layers):
            out.append(recs.l_codes[i, j].tobytes())
            if t.quantized:
                out.append(struct.pack("<f", recs.l_scale[i, j]))
            out.append(recs.r_codes[i, j].tobytes())
            if t.quantized:
                out.append(struct.pack("<f", recs.r_scale[i, j]))
        for k in range(fp.n_indexer_layers):
            out.append(recs.index_rows[k, j].astype("<f4").tobytes())
    return b"".join(out)


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4", "polar5"])
@pytest.mark.parametrize("fp", [FP, FP_DSA], ids=["mla", "dsa"])
def test_writer_matches_reference_layout(tmp_path, fp, tier):
    p = tmp_path / "c.coli_kv"
    a, b = records(fp, tier, 4, seed=1), records(fp, tier, 3, seed=2)
    f = ColiKVFile(p, fp, tier)
    f.load()
    f.append(a)
    f.append(b)
    both = KVRecords.concat([a, b])
    assert p.read_bytes() == reference_bytes(fp, tier, both)
    g = ColiKVFile(p, fp, tier)
    assert same(g.load(), both) and g.message is None
    # ... and a file written by the reference loads to the same records.
    overwrite(p, reference_bytes(fp, tier, both))
    assert same(ColiKVFile(p, fp, tier).load(), both)


@pytest.mark.parametrize("tier", ["kv8", "tq4", "polar3"])
def test_encode_rows_bytes_on_disk(tmp_path, tier):
    _, enc = encoded(FP, tier, 9, seed=4)
    f = ColiKVFile(tmp_path / "c.coli_kv", FP, tier)
    f.load()
    f.append(enc)
    assert (tmp_path / "c.coli_kv").read_bytes() == reference_bytes(FP, tier, enc)


@pytest.mark.parametrize("tier", ["kv8", "tq4"])
def test_v1_upgrade(tmp_path, tier):
    p = tmp_path / "c.coli_kv"
    src, enc = encoded(FP, tier, 6, seed=8)
    overwrite(p, reference_bytes(FP, "f32", src))
    before = digest(p)
    f = ColiKVFile(p, FP, tier)
    assert same(f.load(), enc) and "rewritten as" in f.message
    assert digest(p) == before  # left intact
    more = records(FP, tier, 2, seed=3)
    f.append(more)
    want = KVRecords.concat([enc, more])
    assert p.read_bytes() == reference_bytes(FP, tier, want)  # rewritten in the new format


@pytest.mark.parametrize("file_tier,run_tier,words", [
    ("kv8", "f32", ["KV8=1"]), ("kv8", "polar4", ["KV8=1"]),
    ("tq4", "kv8", ["rotated int4, 4-bit"]), ("f32", "f32", None),
    ("polar3", "tq4", ["codec 0 PolarQuant, 3-bit", "codec 1 rotated int4, 4-bit"]),
])
def test_load_rules(tmp_path, file_tier, run_tier, words):
    p = tmp_path / "c.coli_kv"
    recs = records(FP, file_tier, 3)
    overwrite(p, reference_bytes(FP, file_tier, recs))
    before = digest(p)
    f = ColiKVFile(p, FP, run_tier)
    got = f.load()
    if words is None:
        assert same(got, recs)
        return
    assert len(got) == 0 and all(w in f.message for w in words), f.message
    assert digest(p) == before
    new = records(FP, run_tier, 2, seed=5)
    f.append(new)
    assert p.read_bytes() == reference_bytes(FP, run_tier, new)


def test_other_model_and_bad_headers_start_clean(tmp_path):
    p = tmp_path / "c.coli_kv"
    other = Fingerprint(4, 512, 64, 0, 0, 1000)
    overwrite(p, reference_bytes(other, "kv8", records(other, "kv8", 2)))
    recs = records(FP, "kv8", 2)
    f = ColiKVFile(p, FP, "kv8")
    assert len(f.load()) == 0 and "different model or version" in f.message
    cases = {
        b"COLIKV9\0" + bytes(32): "not a .coli_kv cache",
        b"GGUF\0\0\0\0" + bytes(32): "not a .coli_kv cache",
        b"COLIKV2\0" + struct.pack("<8i", 3, -512, 64, 0, 0, 1000, 0, 1): "impossible header",
        b"COLIKV2\0" + struct.pack("<8i", 3, 512, 64, 0, 0, 1000, -4, 1): "nrec=-4",
        b"COLIKV3\0" + struct.pack("<8i", 3, 512, 64, 0, 0, 1000, 0, 0x0207): "unsupported v3",
        b"COLIKV2\0" + bytes(10): "truncated",
    }
    for data, words in cases.items():
        overwrite(p, data)
        f = ColiKVFile(p, FP, "kv8")
        assert len(f.load()) == 0 and words in f.message and str(p) in f.message, f.message
    f.append(recs)
    assert same(ColiKVFile(p, FP, "kv8").load(), recs)
    with pytest.raises(HeaderError, match="impossible"):
        overwrite(p, b"COLIKV1\0" + struct.pack("<8i", 0, 512, 64, 0, 0, 1000, 0, 0))
        read_header(str(p))


def test_nrec_rules_and_every_truncation(tmp_path):
    p = tmp_path / "c.coli_kv"
    recs = records(SMALL, "kv8", 4, seed=6)
    full = reference_bytes(SMALL, "kv8", recs)
    rec = RecordLayout(SMALL, "kv8").record_bytes
    overwrite(p, reference_bytes(SMALL, "kv8", recs, nrec=0))
    assert len(ColiKVFile(p, SMALL, "kv8").load()) == 0  # nrec < 1: empty
    overwrite(p, reference_bytes(SMALL, "kv8", recs, nrec=2))  # uncommitted records past nrec
    f = ColiKVFile(p, SMALL, "kv8")
    assert same(f.load(), recs.slice(0, 2))
    extra = records(SMALL, "kv8", 1, seed=9)
    f.append(extra)
    assert p.read_bytes() == reference_bytes(SMALL, "kv8", KVRecords.concat([recs.slice(0, 2), extra]))
    for cut in range(40 + 3 * rec, len(full)):  # nrec=4 but the last record is short
        overwrite(p, full[:cut])
        f = ColiKVFile(p, SMALL, "kv8")
        assert same(f.load(), recs.slice(0, 3)), cut
        assert "only 3 are complete" in f.message
    f.append(extra)  # heal: commit word fixed, torn bytes replaced
    assert p.read_bytes() == reference_bytes(SMALL, "kv8", KVRecords.concat([recs.slice(0, 3), extra]))


def test_sanitize_kv8_and_radius(tmp_path):
    p = tmp_path / "c.coli_kv"
    recs = records(FP, "kv8", 8, seed=2)
    bad_scales = [np.nan, -1.0, 0.0, np.inf, 3.4028e38, -np.inf]
    for j, s in enumerate(bad_scales):
        recs.l_scale[j % 3, j] = s
    recs.r_codes[1, 7, :5] = [0x7F, 0xFF, 0x7F, 0x01, 0x81]
    recs.r_scale[1, 7] = 0.5
    overwrite(p, reference_bytes(FP, "kv8", recs))
    f = ColiKVFile(p, FP, "kv8")
    got = f.load()
    for j in range(len(bad_scales)):
        assert got.l_scale[j % 3, j] == 1.0 and not got.l_codes[j % 3, j].any()
    np.testing.assert_array_equal(got.r_codes[1, 7, :5], [0, 0, 0, 0x01, 0x81])
    assert got.r_scale[1, 7] == np.float32(0.5)
    ok = np.ones(got.l_scale.shape, bool)
    for j in range(len(bad_scales)):
        ok[j % 3, j] = False
    np.testing.assert_array_equal(got.l_scale[ok], recs.l_scale[ok])
    assert "rows with invalid scales" in f.message

    t = records(FP, "tq4", 4, seed=3)
    t.r_scale[0, :4] = [np.nan, -2.0, np.inf, 0.0]
    overwrite(p, reference_bytes(FP, "tq4", t))
    got = ColiKVFile(p, FP, "tq4").load()
    np.testing.assert_array_equal(got.r_scale[0, :4], [0, 0, 0, 0])
    np.testing.assert_array_equal(got.r_codes, t.r_codes)  # codes kept; radius 0 decodes to 0


@pytest.mark.parametrize("tier", ["tq4", "polar2", "polar6"])
def test_largest_live_radius_survives_save_load(tmp_path, tier):
    # A row whose norm is exactly float32(3.4e38) is live (inert only above it): its radius
    # is 3.4e38, which the loader used to count as invalid and zero.
    from kernels.cpu.codecs import encode_rows
    src, _ = encoded(FP, tier, 4, seed=11)
    src.l_codes[1, 2] = 0.0
    src.l_codes[1, 2, 7] = np.float32(3.4e38)
    lc, ls = encode_rows(tier, src.l_codes)
    rc, rs = encode_rows(tier, src.r_codes)
    assert ls[1, 2] == np.float32(3.4e38)
    enc = KVRecords(src.tokens, lc, ls, rc, rs)
    f = ColiKVFile(tmp_path / "c.coli_kv", FP, tier)
    f.append(enc)
    g = ColiKVFile(tmp_path / "c.coli_kv", FP, tier)
    assert same(g.load(), enc) and g.message is None


@pytest.mark.parametrize("width,offset", [(64, 0), (64, 1), (512, 4), (36, 4), (10, 3)])
def test_nan_code_scan_matches_plain_check(width, offset):
    from kvstore.records import _has_nan_code
    rng = np.random.default_rng(width + offset)
    rec = width + 12
    buf = rng.integers(0, 0x7F, 400 * rec + offset + 8, dtype=np.uint8)
    buf[rng.integers(0, buf.size, 60)] = rng.choice([0x7F, 0xFF], 60)
    v = np.ndarray((2, 200, width), np.uint8, buffer=buf, offset=offset, strides=(200 * rec, rec, 1))
    want = np.equal(v & 0x7F, 0x7F).any(axis=-1)
    assert 0 < want.sum() < want.size
    np.testing.assert_array_equal(_has_nan_code(v), want)


@pytest.mark.parametrize("claimed", [9, 2**31 - 1])
def test_wrong_nrec_on_a_record_boundary_is_rewritten(tmp_path, claimed):
    # nrec says more records than the file holds, and the file ends on a record boundary
    # (a copy cut between records): no torn bytes, but the commit word is still wrong.
    p = tmp_path / "c.coli_kv"
    recs = records(SMALL, "kv8", 5, seed=12)
    overwrite(p, reference_bytes(SMALL, "kv8", recs, nrec=claimed))
    f = ColiKVFile(p, SMALL, "kv8")
    assert same(f.load(), recs) and f"header says {claimed} records but only 5" in f.message
    f.append(recs.slice(0, 0))  # nothing new: what a worker's release does for a healed file
    assert p.read_bytes() == reference_bytes(SMALL, "kv8", recs)
    g = ColiKVFile(p, SMALL, "kv8")
    assert same(g.load(), recs) and g.message is None


@pytest.mark.parametrize("file_tier", ["f32", "tq4"])  # upgraded / rejected, then rewritten
def test_rewrite_forgets_the_old_files_nrec_fix(tmp_path, file_tier):
    p = tmp_path / "c.coli_kv"
    old = records(SMALL, file_tier, 3, seed=13)
    overwrite(p, reference_bytes(SMALL, file_tier, old, nrec=7))
    f = ColiKVFile(p, SMALL, "kv8")
    f.load()
    new = records(SMALL, "kv8", 6, seed=14)
    f.append(new, start=0)  # the rewrite
    f.append(new.slice(0, 0))  # must not write the old file's record count into the new one
    assert p.read_bytes() == reference_bytes(SMALL, "kv8", new)


@pytest.mark.parametrize("tier,tag", [("tq4", 0x10104), ("tq4", 0x7F000104), ("polar4", 0xFF0004),
                                      ("polar4", 0x1000004), ("polar4", -0xFFFC)])
def test_v3_tag_with_extra_bits_starts_clean(tmp_path, tier, tag):
    # a tag is exactly codec << 8 | bits: a masked parse read 0x10104 as tq4 and 0xFF0004 as
    # polar4, i.e. loaded a file whose header names no known tier
    from kernels.tiers import TierError, tier_from_tag
    with pytest.raises(TierError, match=f"tag {tag:#x}"):
        tier_from_tag(3, tag)
    p = tmp_path / "c.coli_kv"
    data = bytearray(reference_bytes(FP, tier, records(FP, tier, 3)))
    struct.pack_into("<i", data, 36, tag)
    overwrite(p, bytes(data))
    before = digest(p)
    f = ColiKVFile(p, FP, tier)
    assert len(f.load()) == 0 and f.plan.action == "reject" and f.plan.file_tier is None
    assert "unsupported v3" in f.message and str(p) in f.message, f.message
    assert digest(p) == before
    new = records(FP, tier, 2, seed=5)
    f.append(new)  # replaced by a file with the tier's own tag
    assert p.read_bytes() == reference_bytes(FP, tier, new)


@pytest.mark.parametrize("op", ["append", "truncate", "heal"])
def test_writer_refuses_a_file_renamed_over_its_own(tmp_path, op):
    # Another writer (kv convert without the slot lock) renames a new file over the one this
    # object loaded: writing at the loaded file's offsets would corrupt the new file.
    p = tmp_path / "c.coli_kv"
    old = records(FP, "kv8", 6, seed=61)
    overwrite(p, reference_bytes(FP, "kv8", old) + (b"torn" if op == "heal" else b""))
    f = ColiKVFile(p, FP, "kv8")
    assert len(f.load()) == 6
    theirs = records(FP, "kv8", 9, seed=62)
    ColiKVFile(p, FP, "kv8").rewrite(theirs)
    before = digest(p)
    with pytest.raises(OSError, match=rf"{p}: replaced by another file since this writer loaded"):
        f.append(records(FP, "kv8", 2, seed=63)) if op != "truncate" else f.truncate(3)
    assert digest(p) == before
    assert same(ColiKVFile(p, FP, "kv8").load(), theirs)
    f.load()  # a reload adopts the new file
    assert f.append(records(FP, "kv8", 1, seed=64)) == 10


def test_rewrite_with_no_records_writes_a_bare_header(tmp_path):
    """(kv convert of an empty Arrow cache to .coli_kv raised a TypeError in write_all)"""
    path = str(tmp_path / "empty.coli_kv")
    ColiKVFile(path, FP, "kv8").rewrite(records(FP, "kv8", 3).slice(0, 0))
    f = ColiKVFile(path, FP, "kv8")
    assert len(f.load()) == 0 and f.message is None
    assert os.path.getsize(path) == 40  # the header alone


@pytest.mark.parametrize("op", ["append", "truncate", "heal"])
def test_writer_refuses_a_file_truncated_in_place_since_it_loaded(tmp_path, op):
    # Another program (a network share's client, the C engine, a user's truncate) cuts the
    # file in place, keeping its inode: a write at the old offsets left a hole of zeros,
    # which the next load took for records (token 0, zero codes) committed by the nrec word.
    p = tmp_path / "c.coli_kv"
    old = records(FP, "kv8", 6, seed=91)
    overwrite(p, reference_bytes(FP, "kv8", old) + (b"torn" if op == "heal" else b""))
    f = ColiKVFile(p, FP, "kv8")
    assert len(f.load()) == 6
    rec = RecordLayout(FP, "kv8").record_bytes
    os.truncate(p, 40 + 2 * rec + 17)  # 2 whole records and part of a third are left
    before = digest(p)
    with pytest.raises(OSError, match=rf"{p}: holds {40 + 2 * rec + 17} bytes but this writer "
                                      rf"left \d+ there \(another program truncated it"):
        f.append(records(FP, "kv8", 2, seed=92)) if op != "truncate" else f.truncate(5)
    assert digest(p) == before
    g = ColiKVFile(p, FP, "kv8")
    assert same(g.load(), old.slice(0, 2)) and "only 2 are complete" in g.message


def test_load_reads_one_file_when_another_is_renamed_over_it(tmp_path, monkeypatch):
    # The C engine (no slot lock) renames a new tq4 file over a kv8 one just as it is loaded:
    # the header came from the old file and the records from the new one (a ValueError, or
    # another tier's bytes as kv8 records when the new file is long enough).
    import builtins
    import kvstore.coli as coli
    p, theirs = tmp_path / "c.coli_kv", tmp_path / "new.coli_kv"
    ours = records(FP, "kv8", 5, seed=93)
    overwrite(p, reference_bytes(FP, "kv8", ours))
    overwrite(theirs, reference_bytes(FP, "tq4", records(FP, "tq4", 40, seed=94)))

    def open_then_replace(path, *args, **kw):
        fh = builtins.open(path, *args, **kw)
        if os.path.exists(theirs):
            os.replace(theirs, p)
        return fh

    monkeypatch.setattr(coli, "open", open_then_replace, raising=False)
    f = ColiKVFile(p, FP, "kv8")
    assert same(f.load(), ours) and f.message is None  # the file it opened, whole
    monkeypatch.undo()
    with pytest.raises(OSError, match="replaced by another file"):  # and it writes to no other
        f.append(records(FP, "kv8", 1, seed=95))
    assert read_header(str(p))[0] == 3
