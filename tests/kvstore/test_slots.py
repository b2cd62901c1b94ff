"""Slot files: safe collision-free names, one writer per file (flock), lock survives rewrites."""
from __future__ import annotations

import hashlib
import os
import random
import re
import subprocess
import sys

import pytest

from diskdata import FP, records, same
from kvstore.slots import (SlotBusyError, SlotFiles, SlotLock, legacy_filename, slot_filename,
                           unread_legacy)


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


def test_no_name_spells_another_names_file(tmp_path):
    # A clean name that spells out another name's file stem (its cleaned stem + digest)
    # once mapped onto that file and read the other name's saved KV.
    rng = random.Random(5)
    alphabet = "ab_-.~/\\0f9é\0 " + "0123456789abcdef" * 2
    names = {"user/42", "user_42", "", ".", "x" * 300, "x" * 300 + "/"}
    names |= {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14))) for _ in range(3000)}
    for suffix in (".arrow", ".coli_kv"):
        pool = set(names)
        for _ in range(2):  # each name's file stem is a name too, and so on
            pool |= {slot_filename(n, suffix)[:-len(suffix)] for n in pool}
        files = {}
        for n in pool:
            f = slot_filename(n, suffix)
            assert files.setdefault(f, n) == n, (n, files[f], f)
    # The name that spells 'user/42''s file under the earlier rule (stem-sha1[:10]) and
    # 'user/42' itself have files of their own now: a clean name keeps its file, the unclean
    # one's has a "~" no clean name contains.
    old = "user_42-" + hashlib.sha1(b"user/42").hexdigest()[:10]
    assert slot_filename(old, ".arrow") == old + ".arrow"
    assert "~" in slot_filename("user/42", ".arrow")
    s = SlotFiles(tmp_path, FP, "kv8")
    with s.open("user/42") as f:
        f.load()
        f.append(records(FP, "kv8", 5))
    with s.open(old) as f:
        assert len(f.load()) == 0


def test_clean_names_keep_their_file():
    uuid = "3f2a9b1c-0d4e-4a5b-8c7d-1234567890ab"
    for n in ["chat-1", "a_b", "a.b-c", "x" * 80, uuid, "req-" + uuid.replace("-", ""),
              "job-12345678901", "conv-abcdef012", "conv-1733011200", "a-0123456789"]:
        assert slot_filename(n, ".arrow") == n + ".arrow"


def test_no_two_names_share_a_file_where_case_does_not_count():
    # On APFS (macOS default) or a Windows/SMB share, "User-A.arrow" and "user-a.arrow" are
    # one file: the two caches overwrote each other and their writers shared one lock.
    rng = random.Random(7)
    names = {"User-A", "user-a", "USER-A", "Chat-1", "chat-1", "A.B-c", "a.b-c", "CON", "con",
             "Con.x", "lpt1", "nul.arrow", "uuid-3F2A9B1C", "uuid-3f2a9b1c", "x" * 80, "X" * 80}
    alphabet = "aAbB_-.~/0fF9éÉ "
    names |= {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10))) for _ in range(3000)}
    for suffix in (".arrow", ".coli_kv"):
        pool = set(names)
        pool |= {slot_filename(n, suffix)[:-len(suffix)] for n in pool}
        files = {}
        for n in pool:
            f = slot_filename(n, suffix)
            assert files.setdefault(f.casefold(), n) == n, (n, files[f.casefold()], f)
    for n in ("con", "CON", "aux.1", "com1", "Lpt9.log"):  # Windows device names, any case
        assert "~" in slot_filename(n, ".arrow")
    assert slot_filename("User-A", ".arrow").startswith("User-A~")  # still readable


def _legacy_cache(s: SlotFiles, name: str, recs) -> str:
    """A cache file where kvfleet before the case-safe names put slot `name`."""
    path = os.path.join(s.dir, legacy_filename(name, s.cls.suffix))
    f = s.cls(path, FP, "kv8")
    f.load()
    f.append(recs)
    return path


@pytest.mark.parametrize("fmt", ["arrow", "coli"])
def test_a_file_under_the_legacy_name_is_adopted(tmp_path, fmt, caplog):
    s = SlotFiles(tmp_path, FP, "kv8", fmt=fmt)
    recs = records(FP, "kv8", 6, seed=3)
    old = _legacy_cache(s, "User-A", recs)
    assert os.path.basename(old) == "User-A" + s.cls.suffix and s.path("User-A") != old
    with caplog.at_level("WARNING", logger="kvstore.slots"), s.open("User-A") as f:
        assert f.path == s.path("User-A") and same(f.load(), recs)
        assert f.legacy is None  # adopted: no file of the old name is left to be unread
        f.append(records(FP, "kv8", 2, seed=4, start=6))
    assert not os.path.lexists(old) and not os.path.lexists(old + ".lock")
    assert f"renamed {old} to {s.path('User-A')}" in caplog.text
    assert "older kvfleet" not in caplog.text
    with s.open("User-A") as f:  # the next open finds the new file, nothing left to adopt
        assert len(f.load()) == 8 and same(f.load().slice(0, 6), recs)
    with s.open("user-a") as f:  # a lowercase name keeps its file; it is another cache
        assert len(f.load()) == 0


@pytest.mark.parametrize("fmt", ["arrow", "coli"])
def test_a_legacy_file_an_older_kvfleet_writes_again_is_warned_about_and_flagged(tmp_path, fmt,
                                                                                 caplog):
    # A rolling upgrade: a new worker adopted "User-A"'s legacy file, then an old worker on
    # the same directory made it again and saved there. Both files stayed, the new workers
    # read only theirs, and nothing said that the old workers' saves were never loaded.
    s = SlotFiles(tmp_path, FP, "kv8", fmt=fmt)
    ours = records(FP, "kv8", 6, seed=3)
    _legacy_cache(s, "User-A", ours)
    with s.open("User-A") as f:  # adopted
        assert same(f.load(), ours) and f.legacy is None
    theirs = records(FP, "kv8", 4, seed=9)
    old, new = _legacy_cache(s, "User-A", theirs), s.path("User-A")  # the old worker's next save
    before = open(old, "rb").read()
    again = SlotFiles(str(tmp_path) + "/.", FP, "kv8", fmt=fmt)  # another worker of this process
    with caplog.at_level("WARNING", logger="kvstore.slots"):
        for files in (s, s, again):
            with files.open("User-A") as f:
                assert f.legacy == os.path.join(files.dir, os.path.basename(old))  # every open
                assert same(f.load(), ours)  # its own file, nothing of the old one mixed in
    warned = [r.getMessage() for r in caplog.records if "older kvfleet" in r.getMessage()]
    assert len(warned) == 1, warned  # once per directory and name in a process
    assert old in warned[0] and new in warned[0] and "never loaded" in warned[0]
    assert "'User-A'" in warned[0] and "legacy_ignored" in warned[0]
    assert open(old, "rb").read() == before  # not merged, moved or deleted
    assert unread_legacy(old, s.cls.suffix) == ("User-A", new, old)
    assert unread_legacy(new, s.cls.suffix) == ("User-A", new, old)
    _legacy_cache(s, "Chat-7", records(FP, "kv8", 2))  # another name: adopted, then made again
    with s.open("Chat-7"):
        pass
    _legacy_cache(s, "Chat-7", records(FP, "kv8", 2))
    with caplog.at_level("WARNING", logger="kvstore.slots"), s.open("Chat-7") as f:
        assert f.legacy is not None
    assert sum("older kvfleet" in r.getMessage() for r in caplog.records) == 2  # its own warning
    with s.open("user-a") as f:  # a lowercase name has no other file to leave unread
        assert f.legacy is None and len(f.load()) == 0


def test_one_file_under_both_names_is_not_flagged(tmp_path, caplog):
    # a symlink or a hard link between the old name and the new one: one file, all of it read
    s = SlotFiles(tmp_path, FP, "kv8")
    new, old = s.path("User-A"), os.path.join(s.dir, legacy_filename("User-A", ".arrow"))
    recs = records(FP, "kv8", 5, seed=2)
    with s.open("User-A") as f:
        f.load()
        f.append(recs)
    layouts = [lambda: os.symlink(os.path.basename(new), old),  # the old name links to it
               lambda: os.link(new, old),  # a second name of the file
               lambda: (os.rename(new, old), os.symlink(old, new))]  # the new name links to it
    with caplog.at_level("WARNING", logger="kvstore.slots"):
        for make in layouts:
            make()
            assert os.path.lexists(old) and os.path.lexists(new)
            with s.open("User-A") as f:
                assert f.legacy is None and same(f.load(), recs)
            assert unread_legacy(old, ".arrow") is None and unread_legacy(new, ".arrow") is None
            if os.path.islink(new):  # back to the one plain file under the new name
                os.unlink(new)
                os.rename(old, new)
            else:
                os.unlink(old)
    assert "older kvfleet" not in caplog.text


def test_a_case_insensitive_file_systems_other_name_is_not_flagged(tmp_path, monkeypatch, caplog):
    # Simulated as above: "User-A.arrow" resolves to user-a's file, which the directory lists
    # as "user-a.arrow"; "User-A" has a file of its own. That is no older kvfleet's file of
    # "User-A" but user-a's, which user-a reads.
    s = SlotFiles(tmp_path, FP, "kv8")
    for name, seed in (("user-a", 1), ("User-A", 2)):
        with s.open(name) as f:
            f.load()
            f.append(records(FP, "kv8", 3, seed=seed))
    alias = tmp_path / "User-A.arrow"
    os.link(s.path("user-a"), alias)
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: [n for n in real_listdir(d) if n != alias.name])
    with caplog.at_level("WARNING", logger="kvstore.slots"), s.open("User-A") as f:
        assert f.legacy is None and same(f.load(), records(FP, "kv8", 3, seed=2))
    assert "older kvfleet" not in caplog.text
    assert unread_legacy(str(alias), ".arrow") is None
    monkeypatch.setattr(os, "listdir", real_listdir)  # listed as created: an old kvfleet's file
    assert unread_legacy(str(alias), ".arrow") == ("User-A", s.path("User-A"), str(alias))


def test_a_busy_legacy_file_is_not_renamed_under_its_writer(tmp_path):
    s = SlotFiles(tmp_path, FP, "kv8")
    old = _legacy_cache(s, "Chat-7", records(FP, "kv8", 3))
    held = SlotLock(old)  # an older kvfleet still writing it
    try:
        with pytest.raises(SlotBusyError, match=re.escape(old)):
            with s.open("Chat-7"):
                pass
        assert os.path.exists(old) and not os.path.lexists(s.path("Chat-7"))
    finally:
        held.close()
    with s.open("Chat-7") as f:  # let go: adopted
        assert len(f.load()) == 3


def test_a_case_insensitive_file_system_does_not_hand_one_name_anothers_file(tmp_path, monkeypatch,
                                                                             caplog):
    # Simulated: "User-A.arrow" resolves to user-a's file (a second name of its inode) but
    # the directory lists only "user-a.arrow", the case it was created with.
    s = SlotFiles(tmp_path, FP, "kv8")
    mine = records(FP, "kv8", 5, seed=1)
    with s.open("user-a") as f:
        f.load()
        f.append(mine)
    alias = tmp_path / "User-A.arrow"
    os.link(s.path("user-a"), alias)
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda d: [n for n in real_listdir(d) if n != alias.name])
    with caplog.at_level("WARNING", logger="kvstore.slots"), s.open("User-A") as f:
        assert len(f.load()) == 0  # a clean start, not user-a's conversation
        f.append(records(FP, "kv8", 2, seed=2))
    assert "case-insensitive" in caplog.text and s.path("user-a") in caplog.text
    assert "'User-A'" in caplog.text
    with s.open("user-a") as f:
        assert same(f.load(), mine)
    with s.open("user-a"), s.open("User-A"):  # two writers, two locks
        pass


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


def test_a_lock_file_removed_while_an_opener_waits_is_opened_again(tmp_path, monkeypatch):
    """close(remove=True) deletes the lock file while holding it. An opener that had opened
    the old file then locks a deleted file: it must notice and lock the file at the path, or
    it and the next opener (which creates a new lock file) would both hold 'the' lock."""
    import fcntl

    from kvstore import slots
    path = str(tmp_path / "s.coli_kv")
    real_flock, calls = fcntl.flock, []

    def flock_after_a_holder_removed_it(fd, op):
        calls.append(op)
        if len(calls) == 1:  # between this opener's open() and flock(): the holder lets go
            os.unlink(path + ".lock")
        return real_flock(fd, op)

    monkeypatch.setattr(slots.fcntl, "flock", flock_after_a_holder_removed_it)
    first = SlotLock(path)
    monkeypatch.setattr(slots.fcntl, "flock", real_flock)
    try:
        assert os.path.exists(path + ".lock")
        with pytest.raises(SlotBusyError, match=f"pid {os.getpid()}"):
            SlotLock(path)  # the lock at the path is the one `first` holds
    finally:
        first.close(remove=True)
    assert not os.path.exists(path + ".lock")
    SlotLock(path).close()  # free again


def _share(tmp_path, fmt="arrow"):
    """A slot file on 'shared storage' and two cache dirs whose slot 'c' links to it (one
    relative link, one two-hop chain through the other)."""
    s = SlotFiles(tmp_path / "share", FP, "kv8", fmt=fmt)
    target = s.path("real")
    with s.open("real") as f:
        f.load()
        f.append(records(FP, "kv8", 3))
    a, b = SlotFiles(tmp_path / "a", FP, "kv8", fmt=fmt), SlotFiles(tmp_path / "b", FP, "kv8", fmt=fmt)
    os.symlink(os.path.join("..", "share", os.path.basename(target)), a.path("c"))
    os.symlink(a.path("c"), b.path("c"))
    return s, a, b, target


@pytest.mark.parametrize("fmt", ["arrow", "coli"])
def test_two_links_to_one_file_exclude_each_other(tmp_path, fmt):
    # The lock was taken on each link's own sidecar: two jobs whose cache dirs link one slot
    # file onto a share both got it and both appended to (and rewrote) the shared file.
    _, a, b, target = _share(tmp_path, fmt)
    with a.open("c") as f:
        f.load()
        with pytest.raises(SlotBusyError, match=rf"in use by another writer \(pid {os.getpid()}\)") as e:
            with b.open("c"):
                pass
        assert f"{b.path('c')} (a link to {target})" in str(e.value)
        assert e.value.lock_path == target + ".lock" and e.value.holder == str(os.getpid())
    with b.open("c") as f:  # released: the other link gets it, and reads the shared file
        assert len(f.load()) == 3
        with pytest.raises(SlotBusyError, match="a link to"):
            with a.open("c"):
                pass


@pytest.mark.parametrize("fmt", ["arrow", "coli"])
def test_a_link_and_its_targets_own_path_exclude_each_other(tmp_path, fmt):
    s, a, _, target = _share(tmp_path, fmt)
    with a.open("c"):
        with pytest.raises(SlotBusyError) as e:
            with s.open("real"):  # e.g. kv convert run on the share's file
                pass
        assert str(e.value).startswith(f"{target}: ") and e.value.lock_path == target + ".lock"
    with s.open("real"):
        with pytest.raises(SlotBusyError, match=f"a link to {target}"):
            with a.open("c"):
                pass
    # the link's own sidecar is still taken too (a process that locks only it is excluded)
    held = SlotLock(a.path("c"))
    try:
        assert held.lock_paths == [a.path("c") + ".lock", target + ".lock"]
        assert open(a.path("c") + ".lock").read() == str(os.getpid())
        assert open(target + ".lock").read() == str(os.getpid())
    finally:
        held.close()
    SlotLock(target).close()  # all released


def test_a_busy_target_leaves_the_links_sidecar_free(tmp_path):
    s, a, _, target = _share(tmp_path)
    held = SlotLock(target)
    try:
        with pytest.raises(SlotBusyError):
            SlotLock(a.path("c"))
    finally:
        held.close()
    SlotLock(a.path("c")).close()  # the refused opener did not keep the link's sidecar


def test_a_plain_file_keeps_its_one_sidecar(tmp_path):
    path = str(tmp_path / "p.arrow")
    lock = SlotLock(path)
    try:
        assert lock.lock_paths == [path + ".lock"] and lock.lock_path == path + ".lock"
        assert sorted(os.listdir(tmp_path)) == ["p.arrow.lock"]
        assert open(path + ".lock").read() == str(os.getpid())
        with pytest.raises(SlotBusyError) as e:
            SlotLock(path)
        assert str(e.value) == (f"{path}: KV cache file is in use by another writer (pid "
                                f"{os.getpid()}); stop that process or use another --kv-cache-dir")
        assert e.value.lock_path == path + ".lock"
    finally:
        lock.close(remove=True)
    assert os.listdir(tmp_path) == []


def test_a_link_that_does_not_resolve_locks_its_own_sidecar(tmp_path):
    link = str(tmp_path / "c.arrow")
    os.symlink(str(tmp_path / "share" / "gone.arrow"), link)
    lock = SlotLock(link)
    try:
        assert lock.lock_paths == [link + ".lock"]
    finally:
        lock.close(remove=True)
    assert os.listdir(tmp_path) == ["c.arrow"]


def test_removing_a_links_locks_while_held(tmp_path, monkeypatch):
    """close(remove=True) through a link deletes both lock files while holding them; an
    opener that had opened the target's old lock file locks the new one, not the dead one."""
    import fcntl

    from kvstore import slots
    _, a, b, target = _share(tmp_path)
    real_flock, calls = fcntl.flock, []

    def flock_after_a_holder_removed_it(fd, op):
        calls.append(op)
        if len(calls) == 2:  # the target's lock file, between this opener's open and flock
            os.unlink(target + ".lock")
        return real_flock(fd, op)

    monkeypatch.setattr(slots.fcntl, "flock", flock_after_a_holder_removed_it)
    first = SlotLock(a.path("c"))
    monkeypatch.setattr(slots.fcntl, "flock", real_flock)
    try:
        with pytest.raises(SlotBusyError, match="a link to"):
            SlotLock(b.path("c"))  # the target's lock at its path is the one `first` holds
    finally:
        first.close(remove=True)
    assert not os.path.exists(a.path("c") + ".lock") and not os.path.exists(target + ".lock")
    SlotLock(b.path("c")).close()  # free again
