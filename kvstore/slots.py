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
SlotBusyError naming the file and the holder's pid.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
from contextlib import contextmanager

from kernels.tiers import Tier
from kvstore.cachefile import CacheFile
from kvstore.coli import ColiKVFile
from kvstore.disk import ArrowKVFile
from kvstore.fingerprint import Fingerprint

FORMATS: dict[str, type[CacheFile]] = {"arrow": ArrowKVFile, "coli": ColiKVFile}
MAX_STEM = 80


class SlotBusyError(RuntimeError):
    """Another writer holds the slot file's lock; `holder` is its pid as the lock file says."""

    def __init__(self, message: str, holder: str = "unknown"):
        super().__init__(message)
        self.holder = holder


def slot_filename(name: str, suffix: str) -> str:
    """A safe, collision-free file name for slot `name` (see the module docstring)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")[:MAX_STEM]
    if stem == name and stem:
        return name + suffix
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:20]
    return f"{stem or 'slot'}~{digest}{suffix}"


class SlotLock:
    """An exclusive, non-blocking flock on `path`.lock; released by close().

    close(remove=True) also deletes the lock file, while still holding it (`kvfleet kv
    convert` does, so that no OUT.lock is left beside the file it wrote). An opener that got
    the file before it was deleted then holds a lock on a name no one else can open, so
    every opener checks, once locked, that the path still names the file it locked, and
    opens it again when it does not."""

    def __init__(self, path: str):
        self.path, self.lock_path = path, path + ".lock"
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise SlotBusyError(f"{path}: KV cache file is in use by another writer (pid "
                                    f"{holder}); stop that process or use another --kv-cache-dir",
                                    holder) from None
            except OSError:
                os.close(fd)
                raise
            try:
                current = os.stat(self.lock_path)
            except FileNotFoundError:
                current = None
            if current is not None and os.path.samestat(os.fstat(fd), current):
                break
            os.close(fd)  # a holder deleted it as it let go: lock the file that is there now
        self._fd = fd
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def close(self, remove: bool = False) -> None:
        """Releases the lock; with `remove`, deletes the lock file first (safe while held:
        see the class docstring)."""
        if self._fd >= 0:
            if remove:
                try:
                    os.unlink(self.lock_path)
                except FileNotFoundError:
                    pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1


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
