"""`kvfleet kv inspect` / `kvfleet kv convert`: byte-identical conversion, clear errors (exit 2)."""
from __future__ import annotations

import json
import os
import stat
import struct

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from cluster.cli import main
from diskdata import FP, FP_DSA, encoded, overwrite, records, same
import kvstore.coli
from kvstore.coli import ColiKVFile
from kvstore.disk import ArrowKVFile
from kvstore.fingerprint import Fingerprint
from kvstore.records import KVRecords


def write(cls, path, fp, tier, parts):
    f = cls(path, fp, tier)
    f.load()
    for p in parts:
        f.append(p)
    return KVRecords.concat(parts)


def run(capsys, *argv):
    rc = main(list(map(str, argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("tier", ["f32", "kv8", "tq4", "polar6"])
@pytest.mark.parametrize("fp", [FP, FP_DSA], ids=["mla", "dsa"])
def test_convert_round_trip_byte_identical(tmp_path, capsys, tier, fp):
    a, c, a2 = tmp_path / "in.arrow", tmp_path / "out.coli_kv", tmp_path / "back.arrow"
    want = write(ArrowKVFile, a, fp, tier, [records(fp, tier, 5, 1), records(fp, tier, 4, 2)])
    assert run(capsys, "kv", "convert", a, c, "--to", tier)[0] == 0
    direct = tmp_path / "direct.coli_kv"
    write(ColiKVFile, direct, fp, tier, [want])
    assert c.read_bytes() == direct.read_bytes()  # same bytes the .coli_kv writer makes
    assert run(capsys, "kv", "convert", c, a2, "--to", tier)[0] == 0
    assert same(ArrowKVFile(a2, fp, tier).load(), want)
    rc, out, _ = run(capsys, "kv", "inspect", a2)
    assert rc == 0 and "records:      9" in out and "health:       ok" in out


@pytest.mark.parametrize("tier", ["kv8", "tq4", "polar3"])
def test_convert_f32_equals_encode_rows(tmp_path, capsys, tier):
    src, enc = encoded(FP, tier, 11, seed=7)
    write(ColiKVFile, tmp_path / "f.coli_kv", FP, "f32", [src])
    rc, out, _ = run(capsys, "kv", "convert", tmp_path / "f.coli_kv", tmp_path / "q", "--to", tier,
                     "--format", "arrow")
    assert rc == 0 and "wrote 11 records" in out
    assert same(ArrowKVFile(tmp_path / "q", FP, tier).load(), enc)
    # kv8 -> tq4 goes through f32 and says it is lossy
    rc, out, _ = run(capsys, "kv", "convert", tmp_path / "q", tmp_path / "r.coli_kv", "--to", "f32")
    assert rc == 0 and "lossy" in out


def test_inspect_reports_torn_tail_and_model_check(tmp_path, capsys):
    p = tmp_path / "c.arrow"
    write(ArrowKVFile, p, FP, "kv8", [records(FP, "kv8", 3), records(FP, "kv8", 2, 1)])
    overwrite(p, p.read_bytes()[:-10])
    rc, out, _ = run(capsys, "kv", "inspect", p)
    assert rc == 0 and "records:      3" in out and "torn or corrupt tail" in out
    cfg = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "kv_lora_rank": 512, "qk_nope_head_dim": 16, "qk_rope_head_dim": 64, "v_head_dim": 16,
           "intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "model_type": "deepseek_v3", "n_group": 1, "topk_group": 1}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run(capsys, "kv", "inspect", p, "--model", tmp_path / "m")
    assert rc == 0 and "resume with kv8: load" in out
    rc, out, err = run(capsys, "kv", "inspect", p, "--model", tmp_path / "m", "--kv", "tq4")
    assert rc == 2 and "KV8=1" in err and str(p) in err
    # the reason is printed once (it was on stdout in the verdict line and again as the error)
    assert out.strip().splitlines()[-1] == "resume with tq4: reject" and (out + err).count("KV8=1") == 1
    cfg["num_hidden_layers"] = 5
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    rc, out, err = run(capsys, "kv", "inspect", p, "--model", tmp_path / "m")
    assert rc == 2 and "different model" in err and str(p) in err
    assert (out + err).count("different model") == 1


def _bad_files(tmp_path):
    hdr = lambda magic, *h: magic + struct.pack("<8i", *h)  # noqa: E731
    other_arrow = pa.BufferOutputStream()
    with ipc.new_stream(other_arrow, pa.schema([("x", pa.int32())])) as w:
        w.write_batch(pa.record_batch([pa.array([1], pa.int32())], names=["x"]))
    from kvstore.disk import make_schema
    good = make_schema(2, 1, "kv8", FP, 1756)
    meta = dict(good.metadata)
    meta[b"kvfleet.fingerprint"] = b'{"n_layers": -3, "kv_lora": 512, "rope": 64, "index_hd": 0, ' \
                                   b'"n_indexer_layers": 0, "vocab": 1000}'
    negative = good.with_metadata(meta).serialize().to_pybytes()
    meta[b"kvfleet.fingerprint"] = b"{not json"
    garbled = good.with_metadata(meta).serialize().to_pybytes()
    return {
        "neg.arrow": (negative, "impossible header"),
        "garbled.arrow": (garbled, "metadata unreadable"),
        "text.txt": (b"just some text\n", "not a KV cache"),
        "empty.arrow": (b"", "not a KV cache"),
        "magic.coli_kv": (hdr(b"COLIKV7\0", 3, 512, 64, 0, 0, 1000, 0, 1), "not a .coli_kv cache"),
        "negdim.coli_kv": (hdr(b"COLIKV2\0", 3, 512, -64, 0, 0, 1000, 0, 1), "impossible header"),
        "zerolayers.coli_kv": (hdr(b"COLIKV1\0", 0, 512, 64, 0, 0, 1000, 0, 0), "impossible header"),
        "nrec.coli_kv": (hdr(b"COLIKV2\0", 3, 512, 64, 0, 0, 1000, 5, 1) + bytes(100), "nrec=5"),
        "negnrec.coli_kv": (hdr(b"COLIKV2\0", 3, 512, 64, 0, 0, 1000, -1, 1), "nrec=-1"),
        "tag.coli_kv": (hdr(b"COLIKV3\0", 3, 512, 64, 0, 0, 1000, 0, 0x0909), "unsupported v3"),
        "tagbits.coli_kv": (hdr(b"COLIKV3\0", 3, 512, 64, 0, 0, 1000, 0, 0x10104), "tag 0x10104"),
        "tagbits.arrow": (make_schema(3, 0x7F000104, "tq4", FP, 892).serialize().to_pybytes(),
                          "tag 0x7f000104"),
        "v2tag.coli_kv": (hdr(b"COLIKV2\0", 3, 512, 64, 0, 0, 1000, 0, 3), "unsupported KV format"),
        "short.coli_kv": (b"COLIKV2\0\1\0", "truncated"),
        "dsa.coli_kv": (hdr(b"COLIKV1\0", 3, 512, 64, 16, 0, 1000, 0, 0), "index_hd=16"),
        "other.arrow": (other_arrow.getvalue().to_pybytes(), "not a kvfleet KV cache"),
        "torn.arrow": (b"\xff\xff\xff\xff\x10\x00", "not an Arrow IPC stream"),
    }


def test_inspect_bad_input_exit_2_names_file(tmp_path, capsys):
    for name, (data, words) in _bad_files(tmp_path).items():
        p = tmp_path / name
        p.write_bytes(data)
        rc, out, err = run(capsys, "kv", "inspect", p)
        assert rc == 2, (name, out, err)
        assert words in err and str(p) in err, (name, err)
        assert "Traceback" not in err
    rc, _, err = run(capsys, "kv", "inspect", tmp_path / "missing.arrow")
    assert rc == 2 and "no such file" in err


def test_a_directory_is_named_as_one(tmp_path, capsys):
    """`kv inspect DIR` (e.g. the job's --kv-cache-dir) said 'no such file', as if it were
    missing."""
    d = tmp_path / "cache"
    d.mkdir()
    for argv in (("inspect", d), ("convert", d, tmp_path / "x.arrow", "--to", "kv8")):
        rc, _, err = run(capsys, "kv", *argv)
        assert rc == 2 and f"{d}: is a directory; give one KV cache file in it" in err, err


def test_an_input_that_is_no_file_is_named_for_what_it_is(tmp_path, capsys):
    """A FIFO, a dangling symlink (a cache dir linked onto a share that is not mounted) and
    a link loop all said 'no such file'."""
    fifo, dangling, loop = tmp_path / "f.arrow", tmp_path / "d.arrow", tmp_path / "l.arrow"
    os.mkfifo(fifo)
    os.symlink(tmp_path / "share" / "c.arrow", dangling)
    os.symlink(loop, loop)
    want = {fifo: f"{fifo}: is a FIFO, not a regular file",
            dangling: f"{dangling}: a symlink to {str(tmp_path / 'share' / 'c.arrow')!r} that "
                      f"does not resolve",
            loop: f"{loop}: a symlink to {str(loop)!r} that does not resolve"}
    for p, words in want.items():
        for argv in (("inspect", p), ("convert", p, tmp_path / "o.arrow", "--to", "kv8")):
            rc, _, err = run(capsys, "kv", *argv)
            assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not os.path.lexists(tmp_path / "o.arrow")


def test_convert_errors(tmp_path, capsys):
    p = tmp_path / "c.arrow"
    write(ArrowKVFile, p, FP, "f32", [records(FP, "f32", 2)])
    rc, _, err = run(capsys, "kv", "convert", p, tmp_path / "out.bin", "--to", "kv8")
    assert rc == 2 and "out.bin" in err and "--format" in err
    (tmp_path / "junk").write_bytes(b"COLIKV9\0" + bytes(40))
    rc, _, err = run(capsys, "kv", "convert", tmp_path / "junk", tmp_path / "o.arrow", "--to", "kv8")
    assert rc == 2 and "junk" in err
    assert not (tmp_path / "o.arrow").exists()
    (tmp_path / "d.arrow").mkdir()  # an output that is a directory: was an IsADirectoryError
    rc, _, err = run(capsys, "kv", "convert", p, tmp_path / "d.arrow", "--to", "kv8")
    assert rc == 2 and f"{tmp_path / 'd.arrow'}: is a directory" in err
    # hostile f32 rows (NaN/Inf/huge/subnormal) convert without error and stay finite in kv8
    rc, _, _ = run(capsys, "kv", "convert", p, tmp_path / "k.coli_kv", "--to", "kv8")
    got = ColiKVFile(tmp_path / "k.coli_kv", FP, "kv8").load()
    assert rc == 0 and np.isfinite(got.l_scale).all() and (got.l_scale > 0).all()


@pytest.mark.parametrize("to", ["tq4", "polar3"])
def test_convert_refuses_widths_the_rotation_cannot_take(tmp_path, capsys, to):
    # kv_lora 48 is even but not a power of two: the codecs store every such row as inert
    # zeros, so convert used to exit 0 with a file whose rows all decode to nothing.
    fp = Fingerprint(2, 48, 8, 0, 0, 100)
    p = tmp_path / "c.arrow"
    write(ArrowKVFile, p, fp, "f32", [records(fp, "f32", 4)])
    rc, out, err = run(capsys, "kv", "convert", p, tmp_path / "o.arrow", "--to", to)
    assert rc == 2 and f"--to {to}" in err and "kv_lora=48" in err and "wrote" not in out
    assert not (tmp_path / "o.arrow").exists()
    assert run(capsys, "kv", "convert", p, tmp_path / "k.arrow", "--to", "kv8")[0] == 0


@pytest.mark.parametrize("cls", [ArrowKVFile, ColiKVFile])
def test_inspect_flags_a_slots_file_and_the_legacy_file_beside_it(tmp_path, capsys, monkeypatch,
                                                                  cls):
    # Both files of a slot are there: an older kvfleet still saves under the old name, which
    # kvfleet no longer reads. Inspect of either file used to print only "health: ok".
    from kvstore.slots import SlotFiles, legacy_filename
    files = SlotFiles(tmp_path / "cache", FP, "kv8", fmt="arrow" if cls is ArrowKVFile else "coli")
    new = files.path("Chat-7")
    old = os.path.join(files.dir, legacy_filename("Chat-7", cls.suffix))
    write(cls, new, FP, "kv8", [records(FP, "kv8", 3, 1)])
    rc, out, _ = run(capsys, "kv", "inspect", new)
    assert rc == 0 and "legacy:" not in out  # only its own file: nothing to say
    write(cls, old, FP, "kv8", [records(FP, "kv8", 5, 2)])  # the older kvfleet's save
    rc, out, _ = run(capsys, "kv", "inspect", old)
    assert rc == 0 and "records:      5" in out
    assert f"legacy:       not read: the file an older kvfleet gives cache 'Chat-7'; this " \
           f"version reads {new} instead" in out
    rc, out, _ = run(capsys, "kv", "inspect", new)
    assert rc == 0 and "records:      3" in out
    assert f"legacy:       {old} is there too: an older kvfleet still writes cache 'Chat-7'" in out
    monkeypatch.chdir(files.dir)  # a path without a folder
    rc, out, _ = run(capsys, "kv", "inspect", os.path.basename(old))
    assert rc == 0 and "legacy:       not read" in out
    os.unlink(old)
    os.symlink(os.path.basename(new), old)  # the old name a link to the new file: one file
    for p in (old, new):
        rc, out, _ = run(capsys, "kv", "inspect", p)
        assert rc == 0 and "legacy:" not in out


def test_convert_refuses_a_file_a_job_holds(tmp_path, capsys):
    # A running job holds its slot file's lock and appends at the end it loaded: convert must
    # not rename a new file under it (the job's next append would land inside that file).
    from kvstore.slots import SlotFiles
    src = tmp_path / "old.coli_kv"
    theirs = write(ColiKVFile, src, FP, "kv8", [records(FP, "kv8", 20, 5)])
    files = SlotFiles(tmp_path / "cache", FP, "kv8")
    slot = files.path("conv")
    mine = [records(FP, "kv8", 5, 1), records(FP, "kv8", 3, 2, start=5)]
    with files.open("conv") as job:
        job.load()
        job.append(mine[0])
        before = open(slot, "rb").read()
        for argv in ([src, slot], [slot, slot]):  # into the file; the file onto itself
            rc, out, err = run(capsys, "kv", "convert", *argv, "--to", "kv8")
            assert rc == 2 and f"{slot}: KV cache file is in use by a running job" in err, err
            assert f"pid {os.getpid()}" in err and "nothing written" in err and "wrote" not in out
            assert open(slot, "rb").read() == before
        job.append(mine[1])
    g = ArrowKVFile(slot, FP, "kv8")
    assert same(g.load(), KVRecords.concat(mine)) and g.message is None
    # once the job is gone, the same conversions go through (one lock when IN is OUT)
    assert run(capsys, "kv", "convert", slot, slot, "--to", "kv8")[0] == 0
    assert same(ArrowKVFile(slot, FP, "kv8").load(), KVRecords.concat(mine))
    assert run(capsys, "kv", "convert", src, slot, "--to", "kv8")[0] == 0
    assert same(ArrowKVFile(slot, FP, "kv8").load(), theirs)
    with files.open("conv") as job:  # and the convert let go of the lock
        assert len(job.load()) == 20


def _record_bytes_mismatch(path):
    """An Arrow cache whose header passes but whose kvfleet.record_bytes is 8 more than the
    fingerprint's kv8 layout: load() throws it away (clean start)."""
    from kvstore.disk import batch_crc, make_schema
    from kvstore.records import RecordLayout
    lay = RecordLayout(FP, "kv8")
    rb = lay.record_bytes + 8
    schema = make_schema(2, 1, "kv8", FP, rb)
    sink = pa.BufferOutputStream()
    w = ipc.new_stream(sink, schema)
    start = 0
    for seed, n in ((1, 5), (2, 3)):
        r = records(FP, "kv8", n, seed)
        pad = np.full((n, 8), 0xA5, np.uint8)
        pay = np.concatenate([lay.pack(r, with_token=False), pad], axis=1)
        tok = pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(r.tokens)])
        rec = pa.FixedSizeBinaryArray.from_buffers(pa.binary(rb - 4), n, [None, pa.py_buffer(pay)])
        meta = {"kvfleet.start": str(start), "kvfleet.crc32": str(batch_crc(start, r.tokens, pay))}
        w.write_batch(pa.RecordBatch.from_arrays([tok, rec], schema=schema), custom_metadata=meta)
        start += n
    w.close()
    path.write_bytes(sink.getvalue().to_pybytes()[:-8])


def test_file_that_load_throws_away_is_refused(tmp_path, capsys):
    p = tmp_path / "c.arrow"
    _record_bytes_mismatch(p)
    before = p.read_bytes()
    rc, out, err = run(capsys, "kv", "inspect", p)
    assert rc == 2 and "records:" not in out
    assert f"{p}: kvfleet.record_bytes=1764 but kv8 records" in err and "starts clean" in err, err
    for dst in (p, tmp_path / "o.coli_kv"):  # in place (it used to write an empty file) or not
        rc, out, err = run(capsys, "kv", "convert", p, dst, "--to", "kv8")
        assert rc == 2 and "kvfleet.record_bytes=1764" in err and str(p) in err
        assert "wrote" not in out
    assert p.read_bytes() == before and not (tmp_path / "o.coli_kv").exists()
    # a torn tail is not a clean start: inspect reports it, convert keeps the good prefix
    q = tmp_path / "t.arrow"
    want = write(ArrowKVFile, q, FP, "kv8", [records(FP, "kv8", 3), records(FP, "kv8", 2, 1)])
    overwrite(q, q.read_bytes()[:-10])
    rc, out, _ = run(capsys, "kv", "inspect", q)
    assert rc == 0 and "records:      3" in out and "torn or corrupt tail" in out
    rc, out, _ = run(capsys, "kv", "convert", q, q, "--to", "kv8")
    assert rc == 0 and "wrote 3 records" in out
    assert same(ArrowKVFile(q, FP, "kv8").load(), want.slice(0, 3))


def test_inspect_prints_the_tag_the_file_holds(tmp_path, capsys):
    p = tmp_path / "c.coli_kv"
    write(ColiKVFile, p, FP, "polar3", [records(FP, "polar3", 2)])
    rc, out, _ = run(capsys, "kv", "inspect", p)
    assert rc == 0 and "tag 0x3\n" in out
    data = bytearray(p.read_bytes())
    struct.pack_into("<i", data, 36, 0x1000003)  # polar3 plus a stray bit: no known tier
    overwrite(p, bytes(data))
    rc, out, err = run(capsys, "kv", "inspect", p)
    assert rc == 2 and "tag 0x1000003" in err and str(p) in err and "tag 0x3" not in out


def test_inspect_model_check_says_dsa_is_not_resumable(tmp_path, capsys):
    p = tmp_path / "c.arrow"
    write(ArrowKVFile, p, FP_DSA, "kv8", [records(FP_DSA, "kv8", 3)])
    cfg = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
           "kv_lora_rank": 512, "qk_nope_head_dim": 16, "qk_rope_head_dim": 64, "v_head_dim": 16,
           "intermediate_size": 128, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "model_type": "deepseek_v3", "n_group": 1, "topk_group": 1,
           "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run(capsys, "kv", "inspect", p, "--model", tmp_path / "m")
    last = out.strip().splitlines()[-1]
    assert rc == 0 and last.startswith("resume with kv8: not resumable by kvfleet: ")
    assert "does not support DSA models" in last and ": load" not in out


def test_convert_removes_its_lock_file_but_never_a_held_one(tmp_path, capsys):
    """convert left OUT.lock beside every file it wrote, and beside the output it refused to
    write (a bad input); the lock of an output that a job holds must stay, still held."""
    from kvstore.slots import SlotBusyError, SlotLock
    src, dst = tmp_path / "in.arrow", tmp_path / "out.coli_kv"
    write(ArrowKVFile, src, FP, "f32", [records(FP, "f32", 6, 3)])
    assert run(capsys, "kv", "convert", src, dst, "--to", "kv8")[0] == 0
    assert dst.exists() and sorted(os.listdir(tmp_path)) == ["in.arrow", "out.coli_kv"]
    assert run(capsys, "kv", "convert", dst, dst, "--to", "tq4")[0] == 0  # in place
    assert sorted(os.listdir(tmp_path)) == ["in.arrow", "out.coli_kv"]
    junk = tmp_path / "junk.arrow"
    junk.write_bytes(b"not a cache at all")
    rc, _, err = run(capsys, "kv", "convert", junk, tmp_path / "o.arrow", "--to", "kv8")
    assert rc == 2 and "not a KV cache" in err
    assert sorted(os.listdir(tmp_path)) == ["in.arrow", "junk.arrow", "out.coli_kv"]
    held = SlotLock(str(dst))  # a running job's lock
    try:
        rc, _, err = run(capsys, "kv", "convert", src, dst, "--to", "kv8")
        assert rc == 2 and "in use by a running job" in err
        assert (tmp_path / "out.coli_kv.lock").read_text() == str(os.getpid())
        with pytest.raises(SlotBusyError):  # still held: a third writer is refused
            SlotLock(str(dst))
    finally:
        held.close()


def test_convert_through_a_symlinked_slot_file_rewrites_its_target(tmp_path, capsys):
    # A slot file linked onto shared storage: convert in place (a format upgrade) and convert
    # onto the link renamed a regular file over the link, so the share's file kept its old
    # records. The link must stay and its target hold the converted file.
    (tmp_path / "cache").mkdir()
    (tmp_path / "share").mkdir()
    real, link = tmp_path / "share" / "real.arrow", tmp_path / "cache" / "c.arrow"
    src, enc = encoded(FP, "kv8", 7, seed=21)
    write(ArrowKVFile, real, FP, "f32", [src])  # a v1 file
    os.symlink(os.path.join("..", "share", "real.arrow"), link)
    rc, out, _ = run(capsys, "kv", "convert", link, link, "--to", "kv8")
    assert rc == 0 and "wrote 7 records (kv8, arrow)" in out
    assert os.path.islink(link) and os.readlink(link) == os.path.join("..", "share", "real.arrow")
    g = ArrowKVFile(real, FP, "kv8")
    assert same(g.load(), enc) and g.plan.file_tier.version == 2 and g.message is None
    # another file onto a link to a .coli_kv on the share
    coli_real, coli_link = tmp_path / "share" / "real.coli_kv", tmp_path / "cache" / "c.coli_kv"
    write(ColiKVFile, coli_real, FP, "kv8", [records(FP, "kv8", 3, seed=22)])
    os.symlink(coli_real, coli_link)
    assert run(capsys, "kv", "convert", link, coli_link, "--to", "kv8")[0] == 0
    assert os.path.islink(coli_link) and os.readlink(coli_link) == str(coli_real)
    assert same(ColiKVFile(coli_real, FP, "kv8").load(), enc)
    assert sorted(os.listdir(tmp_path / "cache")) == ["c.arrow", "c.coli_kv"]
    assert sorted(os.listdir(tmp_path / "share")) == ["real.arrow", "real.coli_kv"]


def test_convert_onto_a_symlink_that_does_not_resolve_is_refused(tmp_path, capsys):
    src = tmp_path / "in.arrow"
    write(ArrowKVFile, src, FP, "kv8", [records(FP, "kv8", 4, seed=23)])
    out_link = tmp_path / "o.arrow"
    gone = str(tmp_path / "share" / "o.arrow")  # the share is not mounted
    os.symlink(gone, out_link)
    rc, out, err = run(capsys, "kv", "convert", src, out_link, "--to", "kv8")
    assert rc == 2 and f"{out_link}: a symlink to '{gone}' that does not resolve" in err, err
    assert "nothing written" in err and "wrote" not in out
    assert os.path.islink(out_link) and os.readlink(out_link) == gone
    assert sorted(os.listdir(tmp_path)) == ["in.arrow", "o.arrow"]


def test_convert_onto_a_file_a_job_holds_through_a_link_is_refused(tmp_path, capsys):
    # A job held its slot file through a link onto the share; convert run on the share's
    # own path took that path's sidecar, which no one held, and rewrote the file under it.
    from kvstore.slots import SlotLock
    (tmp_path / "cache").mkdir()
    (tmp_path / "share").mkdir()
    src, real, link = tmp_path / "in.arrow", tmp_path / "share" / "real.arrow", tmp_path / "cache" / "c.arrow"
    write(ArrowKVFile, src, FP, "kv8", [records(FP, "kv8", 4, seed=24)])
    write(ArrowKVFile, real, FP, "kv8", [records(FP, "kv8", 2, seed=25)])
    os.symlink(real, link)
    before = real.read_bytes()
    held = SlotLock(str(link))  # the running job's lock
    try:
        rc, out, err = run(capsys, "kv", "convert", src, real, "--to", "kv8")
        assert rc == 2 and f"{real}: KV cache file is in use by a running job" in err, err
        assert f"holds {real}.lock" in err and "wrote" not in out
        assert real.read_bytes() == before
    finally:
        held.close()
    assert run(capsys, "kv", "convert", src, real, "--to", "kv8")[0] == 0  # free: it goes
    assert run(capsys, "kv", "convert", src, link, "--to", "kv8")[0] == 0
    assert sorted(os.listdir(tmp_path / "cache")) == ["c.arrow"]  # no lock file left behind
    assert sorted(os.listdir(tmp_path / "share")) == ["real.arrow"]


def test_convert_onto_a_hard_linked_file_keeps_its_other_names(tmp_path, capsys):
    # An OUT that shares its inode with a `cp -al` snapshot (its lock sidecar linked too):
    # the snapshot must keep its bytes, and convert says that the names are two files now.
    (tmp_path / "cache").mkdir()
    src, out_file = tmp_path / "in.coli_kv", tmp_path / "cache" / "c.arrow"
    _, enc = encoded(FP, "kv8", 6, seed=26)
    write(ColiKVFile, src, FP, "kv8", [enc])
    old = write(ArrowKVFile, out_file, FP, "f32", [records(FP, "f32", 3, seed=27)])
    (tmp_path / "cache" / "c.arrow.lock").write_text("1")
    os.mkdir(tmp_path / "snap")
    for name in ("c.arrow", "c.arrow.lock"):
        os.link(tmp_path / "cache" / name, tmp_path / "snap" / name)
    snap = tmp_path / "snap" / "c.arrow"
    before = snap.read_bytes()
    rc, out, err = run(capsys, "kv", "convert", src, out_file, "--to", "kv8")
    assert rc == 0, err
    assert f"note: {out_file} had other hard links; they keep the old file" in out
    assert snap.read_bytes() == before and same(ArrowKVFile(snap, FP, "f32").load(), old)
    assert same(ArrowKVFile(out_file, FP, "kv8").load(), enc)
    assert os.stat(out_file).st_nlink == 1
    assert sorted(os.listdir(tmp_path / "cache")) == ["c.arrow"]  # its own lock file removed
    assert sorted(os.listdir(tmp_path / "snap")) == ["c.arrow", "c.arrow.lock"]
    # in place (IN = OUT), through a name that is hard-linked again
    os.unlink(snap)
    os.link(out_file, snap)
    before = snap.read_bytes()
    rc, out, _ = run(capsys, "kv", "convert", out_file, out_file, "--to", "tq4")
    assert rc == 0 and "had other hard links" in out
    assert snap.read_bytes() == before and same(ArrowKVFile(snap, FP, "kv8").load(), enc)
    assert len(ArrowKVFile(out_file, FP, "tq4").load()) == 6


def test_convert_creates_the_output_folder_and_removes_it_when_nothing_is_written(tmp_path, capsys,
                                                                                monkeypatch):
    """An output in a folder that did not exist was refused as 'cannot lock the output (No
    such file or directory: OUT.lock)', naming a lock file the user never asked for; it is
    made, as `mkdir -p` would, and said so."""
    src = tmp_path / "in.arrow"
    want = write(ArrowKVFile, src, FP, "kv8", [records(FP, "kv8", 7, 3)])
    dst = tmp_path / "new" / "deeper" / "out.coli_kv"
    rc, out, err = run(capsys, "kv", "convert", src, dst, "--to", "kv8")
    assert rc == 0 and err == "", err
    assert f"note: created the folder {dst.parent}" in out and "wrote 7 records" in out
    assert same(ColiKVFile(dst, FP, "kv8").load(), want) and os.listdir(dst.parent) == ["out.coli_kv"]
    # a convert that writes nothing leaves no folder behind either: a missing input, ...
    rc, out, err = run(capsys, "kv", "convert", tmp_path / "missing.arrow", tmp_path / "a" / "b" / "o.arrow",
                       "--to", "kv8")
    assert rc == 2 and "no such file" in err and "wrote" not in out
    assert not (tmp_path / "a").exists()

    def interrupted(self, recs):  # ... or Ctrl-C in the middle of the write
        raise KeyboardInterrupt
    monkeypatch.setattr(ArrowKVFile, "rewrite", interrupted)
    from cluster.cli import build_parser
    args = build_parser().parse_args(["kv", "convert", str(src), str(tmp_path / "a" / "b" / "o.arrow"),
                                      "--to", "tq4"])
    with pytest.raises(KeyboardInterrupt):
        args.func(args)
    assert not (tmp_path / "a").exists()
    # a file where a folder goes: named, nothing made
    rc, out, err = run(capsys, "kv", "convert", src, src / "x" / "o.arrow", "--to", "kv8")
    assert rc == 2 and f"cannot create its folder {src / 'x'}" in err and "nothing written" in err
    assert sorted(os.listdir(tmp_path)) == ["in.arrow", "new"]


def test_convert_interrupted_keeps_the_old_output(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the middle of the write: one line (exit 130, no traceback) saying what OUT
    holds, and OUT has its old bytes, with no temporary or lock file left beside it."""
    src, dst = tmp_path / "in.arrow", tmp_path / "out.arrow"
    write(ArrowKVFile, src, FP, "f32", [records(FP, "f32", 5, 2)])
    assert run(capsys, "kv", "convert", src, dst, "--to", "kv8")[0] == 0
    before = dst.read_bytes()
    write_new = ArrowKVFile._write_new

    def interrupted(self, tmp, recs):  # the new file half written, then Ctrl-C
        write_new(self, tmp, recs)
        raise KeyboardInterrupt
    monkeypatch.setattr(ArrowKVFile, "_write_new", interrupted)
    rc, out, err = run(capsys, "kv", "convert", src, dst, "--to", "tq4")
    assert rc == 130 and "wrote" not in out and "Traceback" not in err
    assert err == (f"kvfleet kv: interrupted; {dst} is unchanged unless the conversion had "
                   f"finished (the new file replaces it in one rename, once complete)\n")
    assert dst.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["in.arrow", "out.arrow"]


def test_convert_onto_a_fifo_is_refused(tmp_path, capsys):
    # `kvfleet kv convert IN /dev/null` renamed the new file over the output, which, run as
    # root, replaced the device node; a FIFO stands in for it here (no root needed)
    p = tmp_path / "c.arrow"
    write(ArrowKVFile, p, FP, "kv8", [records(FP, "kv8", 3)])
    out = tmp_path / "out" / "fifo"
    out.parent.mkdir()
    os.mkfifo(out)
    for target in (out, tmp_path / "link.arrow"):
        if target != out:
            os.symlink(out, target)
        rc, _, err = run(capsys, "kv", "convert", p, target, "--to", "kv8", "--format", "arrow")
        assert rc == 2 and f"{target}: is a FIFO, not a regular file" in err
        assert "nothing written" in err
    assert stat.S_ISFIFO(os.stat(out).st_mode) and os.listdir(out.parent) == ["fifo"]
    assert sorted(os.listdir(tmp_path)) == ["c.arrow", "link.arrow", "out"]  # no .lock left


@pytest.mark.parametrize("where", ["write", "read"])
def test_a_failing_disk_is_one_error_naming_the_file(tmp_path, capsys, monkeypatch, where):
    # A full disk under the output, or EIO from the input, was a traceback whose last line,
    # "OSError: [Errno 28] No space left on device", named no file
    import errno
    import kvstore.disk
    src, dst = tmp_path / "in.arrow", tmp_path / "out.coli_kv"
    write(ArrowKVFile, src, FP, "kv8", [records(FP, "kv8", 6, 4)])
    assert run(capsys, "kv", "convert", src, dst, "--to", "kv8")[0] == 0
    before = dst.read_bytes()
    code = errno.ENOSPC if where == "write" else errno.EIO
    real = kvstore.coli.write_all

    def fail(fd, data):  # half the bytes land, then the device refuses
        view = memoryview(data).cast("B")
        real(fd, view[:len(view) // 2])
        raise OSError(code, os.strerror(code))

    def eio(self):
        raise OSError(code, os.strerror(code))
    if where == "write":
        monkeypatch.setattr(kvstore.coli, "write_all", fail)
    else:
        monkeypatch.setattr(ArrowKVFile, "_read", eio)
    rc, out, err = run(capsys, "kv", "convert", src, dst, "--to", "kv8")
    assert rc == 2 and "wrote" not in out and "Traceback" not in err
    if where == "write":
        assert err == (f"kvfleet kv: error: {dst}: writing it failed ({os.strerror(code)}); "
                       f"{dst} is unchanged unless the conversion had finished (the new file "
                       f"replaces it in one rename, once complete)\n")
    else:
        assert err == f"kvfleet kv: error: {src}: reading it failed ({os.strerror(code)})\n"
        rc, _, err = run(capsys, "kv", "inspect", src)
        assert rc == 2 and err == f"kvfleet kv: error: {src}: reading it failed ({os.strerror(code)})\n"
    assert dst.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["in.arrow", "out.coli_kv"]
