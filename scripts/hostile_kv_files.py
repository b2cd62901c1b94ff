"""Run hostile KV cache files through the readers a job uses and through `kvfleet kv`.

    PYTHONPATH=. python scripts/hostile_kv_files.py [--quick]

For both formats (Arrow stream, `.coli_kv`) and a few tiers it writes a good three-append
cache, then spoils copies of it the ways a bad disk or network share does (truncation at
every byte, a bit flip at every byte, NaN/Inf scales, newer/older versions, zero length, a
directory, symlink loops, a record count that disagrees with the bytes) and checks, for each:

    load      the job's reader (CacheFile.load) returns a byte-identical prefix of what was
              written, or nothing with a message naming the file; never other records
              silently, never a traceback other than an OSError naming the file
    save      an append after that load, then a fresh load, holds the loaded prefix plus the
              new records (nothing the load kept is lost)
    kv CLI    `kvfleet kv inspect` / `convert` exit 0 or 2, and a 2 names the file

It prints one line per finding (FAIL: ...) and a summary per case family.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import struct
import sys
import tempfile
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kvstore"))
from diskdata import SMALL, records, same  # noqa: E402

from cluster.cli import main as cli  # noqa: E402
from kvstore.coli import ColiKVFile  # noqa: E402
from kvstore.disk import ArrowKVFile  # noqa: E402
from kvstore.records import KVRecords  # noqa: E402

FORMATS = {"arrow": ArrowKVFile, "coli": ColiKVFile}


def write_good(cls, path, tier):
    f = cls(path, SMALL, tier)
    f.load()
    parts = [records(SMALL, tier, n, seed=i + 1, start=s) for i, (n, s) in enumerate([(4, 0), (1, 4), (3, 5)])]
    for p in parts:
        f.append(p)
    return KVRecords.concat(parts)


def prefix_of(got, want) -> bool:
    return len(got) <= len(want) and same(got, want.slice(0, len(got)))


def run_cli(*argv) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli(list(map(str, argv)))
        except SystemExit as e:  # argparse
            rc = int(e.code or 0)
    return rc, out.getvalue() + err.getvalue()


class Checker:
    def __init__(self):
        self.fails: list[str] = []
        self.seen: Counter[str] = Counter()

    def fail(self, case, what):
        self.fails.append(f"FAIL {case}: {what}")
        print(self.fails[-1], flush=True)

    def check(self, case, cls, path, tier, want, cli_too=True, sanitized_ok=False):
        """The rules of the module docstring for one spoiled file."""
        self.seen[case.split("@")[0]] += 1
        path = str(path)
        f = cls(path, SMALL, tier)
        try:
            got = f.load()
        except OSError as e:
            if path not in str(e):
                self.fail(case, f"load OSError without the file name: {e}")
            return
        except Exception as e:  # noqa: BLE001 (that is the finding)
            self.fail(case, f"load raised {type(e).__name__}: {e}")
            return
        if not prefix_of(got, want):
            san = f.message and "zeroed" in f.message
            if not (san and sanitized_ok):
                self.fail(case, f"load returned {len(got)} records that are not a prefix of what "
                                f"was written (message: {f.message})")
                return
        elif len(got) < len(want) and not (f.message and path in f.message):
            self.fail(case, f"load kept {len(got)} of {len(want)} records without a message "
                            f"naming the file ({f.message})")
        if cli_too:
            for argv in (("kv", "inspect", path),
                         ("kv", "convert", path, path + ".out.arrow", "--to", tier)):
                try:
                    rc, text = run_cli(*argv)
                except Exception as e:  # noqa: BLE001
                    self.fail(case, f"{argv[1]} raised {type(e).__name__}: {e}")
                    continue
                if rc not in (0, 2) or (rc == 2 and path not in text):
                    self.fail(case, f"{argv[1]} rc={rc}: {text.strip()[-300:]}")
            if os.path.exists(path + ".out.arrow"):
                os.unlink(path + ".out.arrow")
        # save after the load, then a fresh load keeps the loaded prefix + the new records
        extra = records(SMALL, tier, 2, seed=99, start=len(got))
        try:
            f.append(extra)
        except OSError as e:
            if path not in str(e):
                self.fail(case, f"append OSError without the file name: {e}")
            return
        except Exception as e:  # noqa: BLE001
            self.fail(case, f"append raised {type(e).__name__}: {e}")
            return
        g = cls(path, SMALL, tier)
        back = g.load()
        if not same(back, KVRecords.concat([got, extra])):
            self.fail(case, f"after load ({len(got)}) + append (2) a fresh load holds {len(back)} "
                            f"records, not those ({g.message})")


def spoil(path, data: bytes):
    with open(path, "wb") as fh:
        fh.write(data)


def flip_cases(ck, fmt, tier, tmp, quick):
    cls = FORMATS[fmt]
    good = os.path.join(tmp, f"good{cls.suffix}")
    want = write_good(cls, good, tier)
    data = open(good, "rb").read()
    p = os.path.join(tmp, f"x{cls.suffix}")
    step = 7 if quick else 1
    bounds = []
    if fmt == "arrow":
        g = ArrowKVFile(good, SMALL, tier)
        g.load()
        bounds = [b for _, b in g._bounds]
    for cut in range(0, len(data), step):
        spoil(p, data[:cut])
        if cut in bounds:  # a whole earlier stream: nothing in the file says more followed
            ck.seen["arrow truncated at a batch boundary (a valid earlier file)"] += 1
            continue
        ck.check(f"{fmt}/{tier} truncated@{cut}", cls, p, tier, want, cli_too=cut % 13 == 0)
    for i in range(0, len(data), step):
        for bit in ((i % 8,) if not quick else (7,)) if i >= 48 else range(8):
            b = bytearray(data)
            b[i] ^= 1 << bit
            spoil(p, bytes(b))
            # .coli_kv has no checksum: a flipped code byte cannot be told from a real one
            if fmt == "coli" and i >= 40:
                rec = (len(data) - 40) // len(want)
                off = (i - 40) % rec
                if off >= 4:  # not the token: codes or scales
                    ck.seen["coli code/scale flip (undetectable by format)"] += 1
                    try:
                        cls(p, SMALL, tier).load()
                    except Exception as e:  # noqa: BLE001
                        ck.fail(f"{fmt}/{tier} flip@{i}.{bit}", f"load raised {e!r}")
                    continue
                got = cls(p, SMALL, tier).load()
                if len(got) == len(want) and int((got.tokens != want.tokens).sum()) == 1:
                    ck.seen["coli token flip (prefix reuse stops at it)"] += 1
                    continue
            ck.check(f"{fmt}/{tier} flip@{i}.{bit}", cls, p, tier, want, cli_too=i % 17 == 0,
                     sanitized_ok=fmt == "coli")
    return want, data


def special_cases(ck, fmt, tier, tmp):
    cls = FORMATS[fmt]
    good = os.path.join(tmp, f"good{cls.suffix}")
    want = write_good(cls, good, tier)
    data = open(good, "rb").read()
    p = os.path.join(tmp, f"s{cls.suffix}")
    empty = want.slice(0, 0)

    def reset():
        if os.path.islink(p) or os.path.isfile(p):
            os.unlink(p)
        elif os.path.isdir(p):
            shutil.rmtree(p)

    reset(); spoil(p, b"")
    ck.check(f"{fmt}/{tier} zero-length", cls, p, tier, empty)
    reset(); os.mkdir(p)
    ck.check(f"{fmt}/{tier} directory", cls, p, tier, empty)
    reset(); os.symlink(os.path.basename(p), p)
    ck.check(f"{fmt}/{tier} symlink-loop", cls, p, tier, empty)
    reset(); os.symlink(os.path.join(tmp, "gone", "x"), p)
    ck.check(f"{fmt}/{tier} dangling-symlink", cls, p, tier, empty)
    reset()


def version_cases(ck, tmp):
    """Newer / older format versions, NaN and Inf scales, token/record count mismatch."""
    import json
    import pyarrow as pa
    import pyarrow.ipc as ipc
    from kvstore.disk import batch_crc
    for fmt, cls in FORMATS.items():
        p = os.path.join(tmp, f"v{cls.suffix}")
        want = write_good(cls, p, "kv8")
        data = open(p, "rb").read()
        if fmt == "coli":
            newer = [("coli newer magic COLIKV4", b"COLIKV4\0" + data[8:]),
                     ("coli v2 header, tag 2", data[:36] + struct.pack("<i", 2) + data[40:])]
        else:
            f = ArrowKVFile(p, SMALL, "kv8")
            f.load()
            head = f._bounds[0][1]
            newer = []
            for key, val in ((b"kvfleet.version", b"4"), (b"kvfleet.kv_cache", b"arrow-2")):
                meta = dict(f.schema.metadata)
                meta[key] = val
                sch = ipc.new_stream(sink := pa.BufferOutputStream(), f.schema.with_metadata(meta))
                sch.close()
                newer.append((f"arrow newer {key.decode()}={val.decode()}",
                              sink.getvalue().to_pybytes()[:-8] + data[head:]))
        for case, blob in newer:
            spoil(p, blob)
            g = cls(p, SMALL, "kv8")
            got = g.load()
            ck.seen[case] += 1
            if len(got) or not g.message or p not in g.message:
                ck.fail(case, f"{len(got)} records, message {g.message}")
            else:
                print(f"  ok {case}: {g.message}")
            rc, text = run_cli("kv", "inspect", p)
            print(f"     inspect rc={rc}: {text.strip()[-200:]}")
        # older: a v1 (f32) file under kv8 is upgraded; a torn v1 tail is kept out
        spoil(p, b"")
        os.unlink(p)
        src = write_good(cls, p, "f32")
        data = open(p, "rb").read()
        spoil(p, data[:-3])
        g = cls(p, SMALL, "kv8")
        got = g.load()
        ck.seen[f"{fmt} v1 torn, upgraded under kv8"] += 1
        if not 0 < len(got) < len(src) or "quantized to kv8" not in (g.message or ""):
            ck.fail(f"{fmt} v1 upgrade", f"{len(got)} records, {g.message}")
        g.append(records(SMALL, "kv8", 2, seed=5, start=len(got)))
        back = cls(p, SMALL, "kv8").load()
        if len(back) != len(got) + 2:
            ck.fail(f"{fmt} v1 upgrade", f"after save {len(back)} records")
        os.unlink(p)
        # NaN / Inf / negative scales (in Arrow with a valid crc: a writer bug, not the disk)
        for tier in ("kv8", "tq4"):
            for bad in (np.nan, np.inf, -np.inf, -1.0):
                recs = records(SMALL, tier, 6, seed=3)
                recs.l_scale[1, 2] = bad
                h = cls(p, SMALL, tier)
                h.load()
                h.append(recs)
                g = cls(p, SMALL, tier)
                got = g.load()
                case = f"{fmt}/{tier} scale {bad}"
                ck.seen[case] += 1
                row = got.l_codes[1, 2]
                # kv8: codes 0, scale 1; tq: radius 0 (decodes to zeros whatever the codes)
                inert = ((row == 0).all() and got.l_scale[1, 2] == 1.0 if tier == "kv8"
                         else got.l_scale[1, 2] == 0.0)
                if not (g.message and p in g.message and inert):
                    ck.fail(case, f"message {g.message}, row {row[:4]} scale {got.l_scale[1, 2]}")
                os.unlink(p)
    # Arrow batch whose token column is shorter than its record column (crc over both)
    p = os.path.join(tmp, "m.arrow")
    f = ArrowKVFile(p, SMALL, "kv8")
    f.load()
    recs = records(SMALL, "kv8", 5, seed=4)
    f.append(recs.slice(0, 2))
    width = f.layout.record_bytes - 4
    payload = f.layout.pack(recs.slice(2, 5), with_token=False)
    toks = recs.tokens[2:4].copy()  # 2 tokens, 3 records
    try:
        tok = pa.Array.from_buffers(pa.int32(), 3, [None, pa.py_buffer(toks)])
        col = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), 3, [None, pa.py_buffer(payload)])
        batch = pa.RecordBatch.from_arrays([tok, col], schema=f.schema)
        meta = {"kvfleet.start": "2", "kvfleet.crc32": str(batch_crc(2, toks, payload))}
        with open(p, "ab") as fh, ipc.new_stream(fh, f.schema) as w:
            w.write_batch(batch, custom_metadata=meta)
        g = ArrowKVFile(p, SMALL, "kv8")
        got = g.load()
        ck.seen["arrow token column shorter than records"] += 1
        if not same(got, recs.slice(0, 2)):
            ck.fail("arrow token/record count", f"{len(got)} records, {g.message}")
        else:
            print(f"  ok arrow token/record count: {g.message}")
    except (pa.ArrowInvalid, ValueError) as e:
        print(f"  (pyarrow refused to build the mismatched batch: {e})")


def race_cases(ck, tmp):
    """A file replaced or shrunk while a job has it open; two writers on one slot file."""
    from kvstore.slots import SlotBusyError, SlotFiles
    import kvstore.coli as coli
    for fmt, cls in FORMATS.items():
        # shrunk in place (another program truncated it) between load and append
        p = os.path.join(tmp, f"r{cls.suffix}")
        want = write_good(cls, p, "kv8")
        f = cls(p, SMALL, "kv8")
        got = f.load()
        os.truncate(p, os.path.getsize(p) // 2)
        case = f"{fmt} shrunk in place while open, then append"
        ck.seen[case] += 1
        try:
            f.append(records(SMALL, "kv8", 2, seed=8, start=len(got)))
        except OSError as e:
            print(f"  ok {case}: {e}")
        else:
            g = cls(p, SMALL, "kv8")
            back = g.load()
            if not prefix_of(back, KVRecords.concat([got, records(SMALL, "kv8", 2, seed=8, start=len(got))])):
                ck.fail(case, f"a fresh load holds {len(back)} records that are not what was written "
                              f"(tokens {back.tokens.tolist()}, want {want.tokens.tolist()}...) ({g.message})")
            else:
                print(f"  ok {case}: reload {len(back)} records, {g.message}")
        os.unlink(p)
        # two writers of one slot file (in one process; flock is per open file description)
        files = SlotFiles(tmp, SMALL, "kv8", fmt=fmt)
        case = f"{fmt} two writers on one slot"
        ck.seen[case] += 1
        with files.open("s1") as a:
            try:
                with files.open("s1"):
                    ck.fail(case, "second writer got the lock")
            except SlotBusyError as e:
                if a.path not in str(e):
                    ck.fail(case, str(e))
    # .coli_kv replaced between its header read and its record read
    p = os.path.join(tmp, "swap.coli_kv")
    other = os.path.join(tmp, "other.coli_kv")
    write_good(ColiKVFile, p, "kv8")
    o = ColiKVFile(other, SMALL, "tq4")
    o.load()
    o.append(records(SMALL, "tq4", 12, seed=31))
    import builtins

    def open_then_replace(path, *a, **kw):  # renamed over just after the reader opened it
        fh = builtins.open(path, *a, **kw)
        if os.path.exists(other):
            os.replace(other, path)
        return fh

    coli.open = open_then_replace
    try:
        f = ColiKVFile(p, SMALL, "kv8")
        got = f.load()
    finally:
        del coli.open
    case = "coli renamed over during its load"
    ck.seen[case] += 1
    want = write_good(ColiKVFile, os.path.join(tmp, "ref.coli_kv"), "kv8")
    if len(got) and not prefix_of(got, want):
        ck.fail(case, f"loaded {len(got)} kv8 records made of another file's tq4 bytes "
                      f"(tokens {got.tokens.tolist()}; message {f.message})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    logging.disable(logging.CRITICAL)
    ck = Checker()
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in FORMATS:
            for tier in ("kv8", "tq4", "f32"):
                flip_cases(ck, fmt, tier, tmp, args.quick)
                special_cases(ck, fmt, tier, tmp)
        version_cases(ck, tmp)
        race_cases(ck, tmp)
    for k, v in sorted(ck.seen.items()):
        print(f"  {v:6d}  {k}")
    print(f"{len(ck.fails)} findings")
    return 1 if ck.fails else 0


if __name__ == "__main__":
    sys.exit(main())
