"""Slot files with other hard links (a `cp -al` snapshot, a user's `ln`): a write through one
name gives it a file of its own first, so the other names keep their bytes."""
from __future__ import annotations

import errno
import hashlib
import logging
import os

import pytest

from diskdata import FP, records, same
from kvstore import cachefile
from kvstore.records import KVRecords
from kvstore.slots import SlotBusyError, SlotFiles, SlotLock

FORMATS = [("arrow", "kv8"), ("coli", "tq4"), ("arrow", "f32"), ("coli", "kv8")]


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def snapshot(src, dst) -> None:
    """`cp -al src dst`: every file of src, lock sidecars too, hard-linked into dst."""
    os.makedirs(dst)
    for name in os.listdir(src):
        os.link(os.path.join(src, name), os.path.join(dst, name))


def cache_with(tmp_path, fmt, tier, n=5, seed=1):
    """A cache dir whose slot 'c' holds n records; (SlotFiles, records)."""
    s = SlotFiles(tmp_path / "cache", FP, tier, fmt=fmt)
    old = records(FP, tier, n, seed=seed)
    with s.open("c") as f:
        f.load()
        f.append(old.slice(0, 2))  # two batches / two commits
        f.append(old.slice(2, n))
    return s, old


def load(s: SlotFiles, name="c"):
    with s.open(name) as f:
        return f.load(), f.message


@pytest.mark.parametrize("fmt,tier", FORMATS)
def test_an_append_leaves_the_snapshot_as_it_was(tmp_path, fmt, tier, caplog):
    # The append went into the inode both names share: the snapshot changed under its user.
    s, old = cache_with(tmp_path, fmt, tier)
    snapshot(s.dir, tmp_path / "snap")
    snap = SlotFiles(tmp_path / "snap", FP, tier, fmt=fmt)
    before = digest(snap.path("c"))
    new = records(FP, tier, 3, seed=2, start=5)
    with caplog.at_level(logging.WARNING, "kvstore.cachefile"), s.open("c") as f:
        assert same(f.load(), old)
        f.append(new)
        f.append(records(FP, tier, 2, seed=3, start=8))  # in place now: no second detach
    assert digest(snap.path("c")) == before and f.detached
    got, message = load(snap)
    assert same(got, old) and message is None
    got, message = load(s)
    assert same(got.slice(0, 8), KVRecords.concat([old, new])) and len(got) == 10 and message is None
    assert os.stat(s.path("c")).st_nlink == 1 and os.stat(snap.path("c")).st_nlink == 1
    said = [r.getMessage() for r in caplog.records if "hard links" in r.getMessage()]
    assert said == [f"{s.path('c')}: had 2 hard links (other names shared its bytes, e.g. a "
                    f"`cp -al` snapshot): copied it to a file of its own before writing, so "
                    f"the other names keep their bytes"]
    assert sorted(os.listdir(s.dir)) == sorted(os.listdir(snap.dir))  # no temp file left
    # now two files: a write through each name lands in its own
    more = records(FP, tier, 4, seed=4, start=5)
    with snap.open("c") as f:
        f.load()
        f.append(more)
        assert not f.detached
    assert same(load(snap)[0], KVRecords.concat([old, more]))
    assert len(load(s)[0]) == 10 and digest(s.path("c")) != digest(snap.path("c"))


@pytest.mark.parametrize("fmt,tier", FORMATS[:2])
@pytest.mark.parametrize("keep", [0, 1, 3])
def test_a_cut_leaves_the_other_name_as_it_was(tmp_path, fmt, tier, keep):
    # The prompt's prefix shrank: the cut (inside a batch, at a commit, to nothing)
    # truncated the shared inode.
    s, old = cache_with(tmp_path, fmt, tier)
    other = os.path.join(tmp_path, "other" + s.cls.suffix)
    os.link(s.path("c"), other)  # a user's `ln`; the sidecars are not linked
    before = digest(other)
    with s.open("c") as f:
        f.load()
        f.truncate(keep)
    assert digest(other) == before and same(s.cls(other, FP, tier).load(), old)
    assert same(load(s)[0], old.slice(0, keep))


@pytest.mark.parametrize("fmt,tier", FORMATS[:2])
def test_two_writers_through_two_names_write_two_files(tmp_path, fmt, tier):
    # Each name's sidecar was free, so both writers got their lock and appended at the same
    # offset of one inode: the second append overwrote the first.
    s, old = cache_with(tmp_path, fmt, tier)
    link = SlotFiles(tmp_path / "ln", FP, tier, fmt=fmt)
    os.link(s.path("c"), link.path("c"))
    mine, theirs = records(FP, tier, 3, seed=5, start=5), records(FP, tier, 4, seed=6, start=5)
    with s.open("c") as a, link.open("c") as b:
        assert same(a.load(), old) and same(b.load(), old)
        a.append(mine)
        b.append(theirs)
        a.append(records(FP, tier, 1, seed=7, start=8))
    got_a, got_b = load(s)[0], load(link)[0]
    assert same(got_a.slice(0, 8), KVRecords.concat([old, mine])) and len(got_a) == 9
    assert same(got_b, KVRecords.concat([old, theirs]))


@pytest.mark.parametrize("fmt,tier", FORMATS[:2])
def test_a_snapshots_linked_sidecars_stop_excluding_once_locked(tmp_path, fmt, tier):
    # `cp -al` links the ".lock" sidecars too: the live cache and its snapshot shared one
    # lock, so a job on the snapshot found every slot busy while the other job ran.
    s, old = cache_with(tmp_path, fmt, tier)
    snapshot(s.dir, tmp_path / "snap")
    snap = SlotFiles(tmp_path / "snap", FP, tier, fmt=fmt)
    assert os.stat(snap.path("c") + ".lock").st_nlink == 2
    theirs, mine = records(FP, tier, 2, seed=8, start=5), records(FP, tier, 1, seed=9, start=5)
    with s.open("c") as a, snap.open("c") as b:  # the snapshot's writer gets its own lock
        a.load()
        b.load()
        b.append(theirs)
        a.append(mine)
    for lock in (s.path("c") + ".lock", snap.path("c") + ".lock"):
        assert os.stat(lock).st_nlink == 1
    assert same(load(snap)[0], KVRecords.concat([old, theirs]))
    assert same(load(s)[0], KVRecords.concat([old, mine]))
    # each name is still one writer at a time
    held = SlotLock(snap.path("c"))
    try:
        with pytest.raises(SlotBusyError):
            SlotLock(snap.path("c"))
        SlotLock(s.path("c")).close()
    finally:
        held.close()


@pytest.mark.parametrize("fmt,tier", FORMATS[:2])
def test_a_detach_that_fails_leaves_both_names_whole(tmp_path, fmt, tier, monkeypatch):
    s, old = cache_with(tmp_path, fmt, tier)
    snapshot(s.dir, tmp_path / "snap")
    snap = SlotFiles(tmp_path / "snap", FP, tier, fmt=fmt)
    before = digest(s.path("c"))

    def disk_full(src, dst):
        os.write(dst, os.read(src, 100))  # part of it, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cachefile, "copy_into", disk_full, raising=False)
    new = records(FP, tier, 3, seed=2, start=5)
    with s.open("c") as f:
        f.load()
        with pytest.raises(OSError) as e:
            f.append(new)
        assert e.value.errno == errno.ENOSPC
        assert str(e.value).startswith(f"[Errno {errno.ENOSPC}] {s.path('c')}: has 2 hard links")
        assert "No space left on device" in str(e.value) and "nothing written" in str(e.value)
        assert not f.detached
        for p in (s.path("c"), snap.path("c")):
            assert digest(p) == before and os.stat(p).st_nlink == 2
        assert sorted(os.listdir(s.dir)) == sorted(os.listdir(snap.dir))  # no temp file
        monkeypatch.undo()
        f.append(new)  # space again: the same writer detaches and appends
    assert digest(snap.path("c")) == before and same(load(snap)[0], old)
    assert same(load(s)[0], KVRecords.concat([old, new]))


@pytest.mark.parametrize("fmt,tier", FORMATS[:2])
def test_a_self_heal_does_not_cut_the_other_names_file(tmp_path, fmt, tier):
    # The torn tail was cut off the shared inode (and, for .coli_kv, its nrec rewritten).
    s, old = cache_with(tmp_path, fmt, tier)
    with s.open("c") as f:
        f.load()
        f.append(records(FP, tier, 3, seed=3, start=5))
    os.truncate(s.path("c"), os.path.getsize(s.path("c")) - 37)  # a crash mid-append
    other = os.path.join(tmp_path, "snap" + s.cls.suffix)
    os.link(s.path("c"), other)
    before, size = digest(other), os.path.getsize(other)
    with s.open("c") as f:
        kept = f.load()  # Arrow: the first 5 (the last batch is torn); .coli_kv: 7 of 8
        assert len(kept) == {"arrow": 5, "coli": 7}[fmt] and same(kept.slice(0, 5), old)
        assert f.message is not None
        f.append(f.layout.empty())  # a release with nothing new still heals
    assert digest(other) == before and os.path.getsize(other) == size and f.detached
    g = s.cls(other, FP, tier)
    assert same(g.load(), kept) and g.message is not None  # still torn, as it was
    got, message = load(s)
    assert same(got, kept) and message is None  # healed


@pytest.mark.parametrize("fmt,tier", FORMATS[:2])
def test_a_symlink_onto_a_hard_linked_file_detaches_the_target(tmp_path, fmt, tier):
    share = SlotFiles(tmp_path / "share", FP, tier, fmt=fmt)
    old = records(FP, tier, 4, seed=11)
    with share.open("real") as f:
        f.load()
        f.append(old)
    snapshot(share.dir, tmp_path / "snap")
    cache = SlotFiles(tmp_path / "cache", FP, tier, fmt=fmt)
    os.symlink(share.path("real"), cache.path("c"))
    snap_file = os.path.join(tmp_path, "snap", os.path.basename(share.path("real")))
    before = digest(snap_file)
    new = records(FP, tier, 2, seed=12, start=4)
    with cache.open("c") as f:
        f.load()
        f.append(new)
    assert os.readlink(cache.path("c")) == share.path("real")  # still a link, to a detached file
    assert digest(snap_file) == before and os.stat(share.path("real")).st_nlink == 1
    assert same(load(share, "real")[0], KVRecords.concat([old, new]))
    assert sorted(os.listdir(share.dir)) == sorted(os.listdir(tmp_path / "snap"))


@pytest.mark.parametrize("fmt", ["arrow", "coli"])
def test_a_rewrite_of_a_hard_linked_file_says_so(tmp_path, fmt, caplog):
    # A v1 file upgraded under kv8 is replaced whole (rename: the other name kept its bytes
    # already) but nothing said that the names had become two files.
    s, old = cache_with(tmp_path, fmt, "f32")
    other = os.path.join(tmp_path, "other" + s.cls.suffix)
    os.link(s.path("c"), other)
    before = digest(other)
    kv8 = SlotFiles(s.dir, FP, "kv8", fmt=fmt)
    with caplog.at_level(logging.WARNING, "kvstore.cachefile"), kv8.open("c") as f:
        f.load()
        f.append(records(FP, "kv8", 2, seed=3, start=5))
        assert f.detached
    assert digest(other) == before and same(s.cls(other, FP, "f32").load(), old)
    assert any("had 2 hard links" in r.getMessage() and "replaced it by a file of its own"
               in r.getMessage() for r in caplog.records)
    assert len(load(kv8)[0]) == 7
