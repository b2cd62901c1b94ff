"""Crash safety: writers SIGKILLed at random moments while appending (60 kills in all).

After every kill the file must load as exactly a prefix of what was appended (records are
position-determined, see crash_writer.expected), never a partial record, and at least as
long as the last append the writer acknowledged after its fsync.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import crash_writer
from diskdata import FP, encoded, records, same
from kvstore.coli import ColiKVFile
from kvstore.disk import ArrowKVFile
from kvstore.records import KVRecords

CLASSES = {"arrow": ArrowKVFile, "coli": ColiKVFile}
MAX_BYTES = 24 << 20  # start a fresh file past this, to keep each reload cheap


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")  # forks from a process with numpy/pyarrow already imported
    # pytest too: each child re-runs the parent's __main__ (the pytest script) as __mp_main__
    c.set_forkserver_preload(["crash_writer", "pytest"])
    return c


@pytest.mark.slow
@pytest.mark.parametrize("fmt,tier,kills,max_chunk,linked", [
    ("arrow", "f32", 20, 256, False), ("arrow", "kv8", 15, 256, False),
    ("coli", "kv8", 25, 128, False), ("arrow", "kv8", 10, 256, True), ("coli", "f32", 10, 128, True),
])
def test_sigkill_while_appending(tmp_path, ctx, fmt, tier, kills, max_chunk, linked):
    """linked: before each writer starts, the file gets a second name (a hard link, as in a
    `cp -al` snapshot), which must keep its bytes whenever the writer is killed (it detaches
    the file before its first write)."""
    path = str(tmp_path / f"c.{fmt}")
    rng = np.random.default_rng(1234)
    stats = {"torn": 0, "files": 1, "max_records": 0}
    acked = 0  # records the writers acknowledged (fsync'd) in the current file
    t0 = time.monotonic()

    def take(msg):
        nonlocal acked
        what, n = msg
        if what == "acked":
            acked = max(acked, n)
        else:
            assert n >= acked, f"a writer loaded {n} records after {acked} were acknowledged"
        return what

    for kill in range(kills):
        assert time.monotonic() - t0 < 120, f"only {kill} kills in 120 s"
        snap = None
        if linked and os.path.exists(path):
            snap = f"{path}.snap"
            os.link(path, snap)
            snap_bytes = hashlib.sha256(open(snap, "rb").read()).hexdigest()
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=crash_writer.write_forever, args=(path, fmt, FP, tier, max_chunk, child))
        p.start()
        child.close()
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0.0, 0.05))  # while starting, loading or on the first write
        else:  # after 0-2 acknowledged appends, at a random moment of the next one
            want, loaded, acks = int(rng.integers(0, 3)), False, 0
            while (not loaded or acks < want) and parent.poll(30):
                if take(parent.recv()) == "loaded":
                    loaded = True
                else:
                    acks += 1
            time.sleep(rng.uniform(0.0, 0.02))
        os.kill(p.pid, signal.SIGKILL)
        p.join(20)
        assert p.exitcode == -signal.SIGKILL, p.exitcode
        while parent.poll():
            try:
                take(parent.recv())
            except EOFError:
                break
        parent.close()
        if snap is not None:
            assert hashlib.sha256(open(snap, "rb").read()).hexdigest() == snap_bytes, f"kill {kill}"
            os.unlink(snap)

        f = CLASSES[fmt](path, FP, tier)
        got = f.load() if os.path.exists(path) else None
        if got is None:
            assert acked == 0
            continue
        assert f.plan is None or f.plan.action == "load", f.message
        stats["torn"] += bool(f.message)
        assert len(got) >= acked, f"kill {kill}: lost fsync'd records ({len(got)} < {acked})"
        assert same(got, crash_writer.expected(FP, tier, 0, len(got))), f"kill {kill}: not a prefix"
        stats["max_records"] = max(stats["max_records"], len(got))
        if os.path.getsize(path) > MAX_BYTES:
            os.unlink(path)
            acked, stats["files"] = 0, stats["files"] + 1
    print(f"{fmt}/{tier}: {kills} kills in {time.monotonic() - t0:.1f} s, {stats}")
    assert stats["max_records"] > 0


@pytest.mark.parametrize("fmt", ["arrow", "coli"])
def test_rewrite_is_atomic(tmp_path, fmt, monkeypatch):
    """A crash inside an upgrade/replace rewrite leaves the old file whole; a stale temp
    file from a killed writer is simply overwritten by the next rewrite."""
    path = tmp_path / f"c.{fmt}"
    src, enc = encoded(FP, "kv8", 5, seed=2)
    f = CLASSES[fmt](path, FP, "f32")
    f.load()
    f.append(src)
    before = path.read_bytes()
    up = CLASSES[fmt](path, FP, "kv8")
    assert same(up.load(), enc)  # v1 quantized in memory

    def crash(*_):
        raise OSError("simulated crash before the rename")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        up.append(records(FP, "kv8", 2, seed=3))
    monkeypatch.undo()
    assert path.read_bytes() == before  # the v1 file is untouched
    (tmp_path / f"c.{fmt}.tmp").write_bytes(b"garbage left by a SIGKILLed writer")
    again = CLASSES[fmt](path, FP, "kv8")
    again.load()
    more = records(FP, "kv8", 2, seed=3)
    again.append(more)
    assert same(CLASSES[fmt](path, FP, "kv8").load(), KVRecords.concat([enc, more]))
    assert not (tmp_path / f"c.{fmt}.tmp").exists()
