"""Slot files: safe collision-free names, one writer per file (flock), lock survives rewrites."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diskdata import FP, records, same
from kvstore.slots import SlotBusyError, SlotFiles, slot_filename


def test_names_are_safe_and_distinct(tmp_path):
    names = ["chat-1", "a/b", "a_b", "../../etc/passwd", ".hidden", "..", ".", "", "x" * 300,
             "x" * 300 + "y", "naïve", "nai_ve", "tab\there", "C:\\evil", "a\0b"]
    files = [slot_filename(n, ".arrow") for n in names]
    assert len(set(files)) == len(files)
    assert files[0] == "chat-1.arrow"  # a clean name is kept as is
    for f in files:
        assert "/" not in f and "\\" not in f and "\0" not in f
        assert not f.startswith(".") and len(f) < 110
    s = SlotFiles(tmp_path / "cache", FP, "kv8")
    for n in names:
        assert os.path.dirname(s.path(n)) == str(tmp_path / "cache")


def test_second_writer_refused_then_allowed(tmp_path):
    s = SlotFiles(tmp_path, FP, "kv8", fmt="coli")
    recs = records(FP, "kv8", 3)
    with s.open("slot 0") as f:
        f.load()
        f.append(recs)
        with pytest.raises(SlotBusyError, match=rf"in use by another writer \(pid {os.getpid()}\)") as e:
            with s.open("slot 0"):
                pass
        assert s.path("slot 0") in str(e.value)
        with s.open("slot 1"):  # other slots are independent
            pass
        f.rewrite(recs.slice(0, 2))  # atomic replace of the data file keeps the lock
        with pytest.raises(SlotBusyError):
            with s.open("slot 0"):
                pass
    with s.open("slot 0") as f:
        assert same(f.load(), recs.slice(0, 2))


def test_other_process_refused(tmp_path):
    s = SlotFiles(tmp_path, FP, "tq4")
    code = ("import sys\nfrom kvstore.slots import SlotFiles, SlotBusyError\n"
            "from kvstore.fingerprint import Fingerprint\n"
            f"s = SlotFiles({str(tmp_path)!r}, Fingerprint(3, 512, 64, 0, 0, 1000), 'tq4')\n"
            "try:\n    s.open('w').__enter__()\nexcept SlotBusyError as e:\n    print(e); sys.exit(3)\n")
    with s.open("w"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 3, r.stderr
        assert f"pid {os.getpid()}" in r.stdout and s.path("w") in r.stdout
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_bad_format():
    with pytest.raises(ValueError, match="fmt='parquet'"):
        SlotFiles("/tmp", FP, "kv8", fmt="parquet")
