"""Slot cache files under one cache directory, one writer per file.

    files = SlotFiles(cache_dir, fingerprint, tier, fmt="arrow")   # or "coli"
    with files.open("user-42/chat") as f:     # f is an ArrowKVFile / ColiKVFile
        recs = f.load()
        ...
        f.append(new_records)

A slot name becomes a file name by `slot_filename`: a clean name (only [a-z0-9._-], no
leading dot, at most MAX_STEM characters, not a Windows device name such as "con" or
"lpt1" before its first dot) is kept as is; any other name has the characters outside
[A-Za-z0-9._-] turned into "_" and its leading dots dropped, is cut to MAX_STEM, and gets
"~" and 80 bits of the sha256 of the original appended. No clean name contains "~", so two
different names never share a file, and no name can leave the directory. Nor do they on a
case-insensitive file system (macOS APFS by default, a Windows or SMB share): a clean name
has no capitals and the digest is lowercase hex, so no two names' files differ only in
case ("User-A" gets "User-A~<digest>", not a file that "user-a" would share).

Before that rule, a name with capitals (or a device name) that was otherwise clean kept
its name as its file (`legacy_filename`). `SlotFiles.open` adopts such a file: when the
name's own file does not exist but its legacy file does, under the legacy file's lock too,
it renames the legacy file to the new name (logged). On a case-insensitive file system the
legacy file of "User-A" is the same file as "user-a"'s; it is adopted only if the
directory lists it under exactly the legacy name (the case-preserved name it was created
with), else it is left to the name that spells it and "User-A" starts a file of its own
(logged, naming both).

In a fleet being upgraded, an older kvfleet on the same directory keeps writing (or makes
again) the legacy file after this version adopted it: then both files are there, and this
version reads only its own, so what the older one saves is never loaded. `SlotFiles.open`
says so: when the name's legacy file is there beside its file and is another file (not the
same file through a symlink or a hard link, nor on a case-insensitive file system another
name's file, as above), it logs a warning naming both, once per directory and name in a
process, and sets the opened file's `legacy` to the legacy file's path on every open
(workers/persist.py counts it as the "legacy_ignored" cache event). `unread_legacy` tells
the same of any file (`kvfleet kv inspect`). The legacy file is neither read nor changed:
an older writer may hold it open.

Each file is
guarded by an exclusive `fcntl.flock` on a sidecar "<file>.lock" (not on the data file,
which an atomic rewrite replaces); a second writer, in this process or another, gets
SlotBusyError naming the file and the holder's pid. A slot file that is a symlink (onto
shared storage) is written through to its target, so its lock is the link's sidecar and
also the target's, "<target>.lock": two links to one file, or a link and the file's own
path, exclude each other. Hard links are not tied together that way (a name cannot find
the others): two names of one file, e.g. a slot file and its copy in a `cp -al` snapshot,
have a sidecar each, and kvfleet detaches the file before writing into it through one of
them (kvstore/cachefile.py), so the other names keep their bytes and each name becomes a
file of its own. A sidecar that is itself hard-linked (`cp -al` links the ".lock" files
too) is replaced by a new one when it is locked, so the two names' writers do not exclude
each other once their files are separate.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import threading
from contextlib import contextmanager

from kernels.tiers import Tier
from kvstore.cachefile import CacheFile, fsync_dir, rewrite_target
from kvstore.coli import ColiKVFile
from kvstore.disk import ArrowKVFile
from kvstore.fingerprint import Fingerprint

log = logging.getLogger(__name__)

FORMATS: dict[str, type[CacheFile]] = {"arrow": ArrowKVFile, "coli": ColiKVFile}
MAX_STEM = 80
# names Windows reserves for devices, with any extension ("con.arrow" opens the console)
DEVICE_NAMES = frozenset(["con", "prn", "aux", "nul", *(f"{d}{i}" for d in ("com", "lpt")
                                                        for i in range(10))])


# (cache dir, slot name) whose unread legacy file this process has warned about: once each,
# however many SlotFiles (workers of one process) open it
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class SlotBusyError(RuntimeError):
    """Another writer holds the slot file's lock; `holder` is its pid as the lock file
    `lock_path` says."""

    def __init__(self, message: str, holder: str = "unknown", lock_path: str = ""):
        super().__init__(message)
        self.holder, self.lock_path = holder, lock_path


def slot_filename(name: str, suffix: str) -> str:
    """A safe file name for slot `name`, distinct from every other name's even where case
    does not count (see the module docstring)."""
    stem = _stem(name)
    if stem and stem == name and stem == stem.lower() and stem.split(".")[0] not in DEVICE_NAMES:
        return name + suffix
    return _hashed(name, stem, suffix)


def legacy_filename(name: str, suffix: str) -> str:
    """The file name that kvfleet gave slot `name` before slot_filename kept case-insensitive
    file systems apart: capitals and device names kept as is."""
    stem = _stem(name)
    return name + suffix if stem == name and stem else _hashed(name, stem, suffix)


def unread_legacy(path: str, suffix: str) -> tuple[str, str, str] | None:
    """(slot name, the name's file, its legacy file) when `path` is one of the two and the
    legacy file is there beside the name's file as another file: an older kvfleet's, which
    this version does not read (see the module docstring). None otherwise, or when `path`
    (ending in `suffix`) is no file of a name whose legacy file differs from its own."""
    folder, base = os.path.split(path)
    if not base.endswith(suffix) or len(base) == len(suffix):
        return None
    # a name with a legacy file of its own is its file's stem (legacy) or the stem before
    # the "~" (new), since no character of such a name is cleaned away
    name = base[:-len(suffix)].split("~")[0]
    new, old = slot_filename(name, suffix), legacy_filename(name, suffix)
    if new == old or base not in (new, old):
        return None
    new, old = os.path.join(folder, new), os.path.join(folder, old)
    return (name, new, old) if _another_file(new, old) else None


def _another_file(new: str, old: str) -> bool:
    """Whether the legacy file `old` is there beside the slot file `new` and is not the same
    file (a symlink, a hard link, or a case-insensitive file system's other name's file)."""
    if not (os.path.lexists(new) and os.path.lexists(old)) or _listed_as(old) != old:
        return False
    return not os.path.samestat(_stat(new), _stat(old))


def _listed_as(path: str) -> str:
    """`path` as its directory lists it: itself, or on a case-insensitive file system the
    entry that differs from it only in case ("?" if none)."""
    folder, base = os.path.split(path)
    listed = os.listdir(folder or ".")
    if base in listed:
        return path
    return os.path.join(folder, next((f for f in listed if f.casefold() == base.casefold()), "?"))


def _stat(path: str) -> os.stat_result:
    """The stat of the file `path` names; of the link itself where it does not resolve."""
    try:
        return os.stat(path)
    except OSError:
        return os.lstat(path)


def _stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:MAX_STEM]


def _hashed(name: str, stem: str, suffix: str) -> str:
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:20]
    return f"{stem or 'slot'}~{digest}{suffix}"


class SlotLock:
    """An exclusive, non-blocking flock on `path`.lock; released by close().

    A `path` that is a symlink is read and rewritten through to the file at the end of its
    chain (cachefile.rewrite_target), so it is locked there too: `<target>.lock` beside the
    target, after `path`.lock (kept, so that a process that locks only the link's sidecar,
    as kvfleet did before, is still excluded). A link that does not resolve has only its own
    sidecar to lock; loading or rewriting it refuses (cachefile.unresolved_link). A plain
    file has the one sidecar `path`.lock, as ever. `lock_paths` lists what is held. A lock
    file with other hard links (a `cp -al` snapshot's sidecar) is swapped, once locked, for
    one of its own (_own_lock).

    close(remove=True) also deletes the lock files, while still holding them (`kvfleet kv
    convert` does, so that no OUT.lock is left beside the file it wrote). An opener that got
    a file before it was deleted then holds a lock on a name no one else can open, so every
    opener checks, once locked, that the path still names the file it locked, and opens it
    again when it does not."""

    def __init__(self, path: str):
        self.path, self.lock_path = path, path + ".lock"
        try:
            target = rewrite_target(path)
        except OSError:  # a link that does not resolve: nothing beyond it to lock
            target = path
        self.lock_paths = [self.lock_path]
        if target != path:
            self.lock_paths.append(target + ".lock")
        self._fds: list[int] = []
        try:
            for lock_path in self.lock_paths:
                name = path if lock_path == self.lock_path else f"{path} (a link to {target})"
                self._fds.append(_lock(lock_path, name))
        except BaseException:
            self._release(remove=False)
            raise

    def close(self, remove: bool = False) -> None:
        """Releases the lock; with `remove`, deletes the lock files first (safe while held:
        see the class docstring)."""
        self._release(remove)

    def _release(self, remove: bool) -> None:
        if remove:
            for lock_path in self.lock_paths[:len(self._fds)]:
                try:
                    os.unlink(lock_path)
                except FileNotFoundError:
                    pass
        for fd in reversed(self._fds):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._fds = []


def _lock(lock_path: str, name: str) -> int:
    """An fd holding the flock of `lock_path` (created if missing), with our pid written in;
    SlotBusyError naming `name` when another writer holds it."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise SlotBusyError(f"{name}: KV cache file is in use by another writer (pid "
                                f"{holder}); stop that process or use another --kv-cache-dir",
                                holder, lock_path) from None
        except OSError:
            os.close(fd)
            raise
        try:
            current = os.stat(lock_path)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(os.fstat(fd), current):
            if current.st_nlink > 1:
                fd = _own_lock(fd, lock_path)
            break
        os.close(fd)  # a holder deleted it as it let go: lock the file that is there now
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _own_lock(fd: int, lock_path: str) -> int:
    """In place of the held lock file `fd` at `lock_path`, which has other hard links (the
    sidecar of another name, e.g. in a `cp -al` snapshot): a new lock file, locked before it
    is renamed over `lock_path`, so that the lock is never free there; then `fd` is let go.
    An opener that had opened the old file finds that the path names another (_lock)."""
    tmp = lock_path + ".tmp"  # only the holder of lock_path's file makes it
    new = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(tmp, lock_path)
    except BaseException:
        os.close(new)
        if os.path.exists(tmp):
            os.unlink(tmp)
        os.close(fd)
        raise
    os.close(fd)  # (closing it lets go of its flock)
    return new


class SlotFiles:
    def __init__(self, cache_dir: str | os.PathLike, fp: Fingerprint, tier: Tier | str,
                 fmt: str = "arrow"):
        if fmt not in FORMATS:
            raise ValueError(f"KV cache format {fmt=} must be one of {sorted(FORMATS)}")
        self.dir, self.fp, self.tier, self.cls = os.fspath(cache_dir), fp, tier, FORMATS[fmt]
        os.makedirs(self.dir, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, slot_filename(name, self.cls.suffix))

    @contextmanager
    def open(self, name: str):
        """The slot's cache file, locked for writing while the context is open."""
        path = self.path(name)
        lock = SlotLock(path)
        try:
            if self._adopt_legacy(name, path) and os.path.islink(path):
                lock.close()  # a link now: lock its target too, as for any linked slot file
                lock = SlotLock(path)
            f = self.cls(path, self.fp, self.tier)
            f.legacy = self._unread_legacy(name, path)
            yield f
        finally:
            lock.close()

    def _adopt_legacy(self, name: str, path: str) -> bool:
        """Rename the file that `legacy_filename` gave `name` to `path`, if `path` does not
        exist and the legacy file is this name's (module docstring). Called holding path's
        lock; takes the legacy file's lock, so a writer of it (an older kvfleet, or on a
        case-insensitive file system the name that spells it) is a SlotBusyError."""
        old = os.path.join(self.dir, legacy_filename(name, self.cls.suffix))
        if old == path or os.path.lexists(path) or not os.path.lexists(old):
            return False
        spelt = _listed_as(old)
        if spelt != old:  # a case-insensitive file system found another name's file
            other = os.path.basename(spelt)
            log.warning("cache %r: not resuming from %s: on this case-insensitive file system "
                        "that is the file %s of the cache %r, a name that differs only in "
                        "case; %r keeps a file of its own, %s", name, old, spelt,
                        other[:-len(self.cls.suffix)] or other, name, path)
            return False
        legacy = SlotLock(old)
        try:
            if os.path.lexists(path) or not os.path.lexists(old):  # (changed meanwhile)
                return False
            os.rename(old, path)  # (a link is renamed, not its target)
            fsync_dir(path)
        finally:
            legacy.close(remove=True)  # its sidecar: no kvfleet of this version locks it again
        log.warning("cache %r: renamed %s to %s (file names that stay distinct on "
                    "case-insensitive file systems)", name, old, path)
        return True

    def _unread_legacy(self, name: str, path: str) -> str | None:
        """The legacy file of `name` when it is there beside `path` as another file (an older
        kvfleet still writes it); warned about once per directory and name in this process."""
        old = os.path.join(self.dir, legacy_filename(name, self.cls.suffix))
        if old == path or not _another_file(path, old):
            return None
        key = (os.path.realpath(self.dir), name)
        with _warned_lock:
            first = key not in _warned
            _warned.add(key)
        if first:
            log.warning("cache %r: %s is there beside its file %s: an older kvfleet (before "
                        "file names that stay distinct on case-insensitive file systems) is "
                        "still writing this cache under its old name, and this version reads "
                        "only its own file, so what the older one saves there is never loaded "
                        "(counted as the legacy_ignored cache event; said once per process). "
                        "Stop or upgrade the older kvfleet workers on this directory; the old "
                        "file is left as it is", name, old, path)
        return old
