"""Slot cache files under one cache directory, one writer per file.

    files = SlotFiles(cache_dir, fingerprint, tier, fmt="arrow")   # or "coli"
    with files.open("user-42/chat") as f:     # f is an ArrowKVFile / ColiKVFile
        recs = f.load()
        ...
        f.append(new_records)

A slot name becomes a file name by `slot_filename`: a clean name (only [A-Za-z0-9._-], no
leading dot, at most MAX_STEM characters) is kept as is; any other name has the characters
outside that set turned into "_" and its leading dots dropped, is cut to MAX_STEM, and gets
"~" and 80 bits of the sha256 of the original appended. No clean name contains "~", so two
different names never share a file, and no name can leave the directory. Each file is
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
import os
import re
from contextlib import contextmanager

from kernels.tiers import Tier
from kvstore.cachefile import CacheFile, rewrite_target
from kvstore.coli import ColiKVFile
from kvstore.disk import ArrowKVFile
from kvstore.fingerprint import Fingerprint

FORMATS: dict[str, type[CacheFile]] = {"arrow": ArrowKVFile, "coli": ColiKVFile}
MAX_STEM = 80


class SlotBusyError(RuntimeError):
    """Another writer holds the slot file's lock; `holder` is its pid as the lock file
    `lock_path` says."""

    def __init__(self, message: str, holder: str = "unknown", lock_path: str = ""):
        super().__init__(message)
        self.holder, self.lock_path = holder, lock_path


def slot_filename(name: str, suffix: str) -> str:
    """A safe, collision-free file name for slot `name` (see the module docstring)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:MAX_STEM]
    if stem == name and stem:
        return name + suffix
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
            yield self.cls(path, self.fp, self.tier)
        finally:
            lock.close()
