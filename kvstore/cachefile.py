"""The life of one on-disk KV cache file, shared by the Arrow and `.coli_kv` formats.

    f = ArrowKVFile(path, fingerprint, tier)      # or ColiKVFile
    recs = f.load()        # KVRecords to put in the pool (maybe empty); f.message says why
    f.append(new, start)   # records for positions [start, start+len(new)), durable on return
    f.truncate(n)          # keep the first n records (the prompt's prefix shrank)

`load` applies the rules of kvstore/fingerprint.py plan_load. The file is never modified by
`load`: a torn tail is only cut off (self-heal) when the file is next opened for writing, a
v1 file being upgraded and a rejected file are only replaced, atomically (write a temp file,
fsync, rename, fsync the directory; for a slot file that is a symlink, all in the link's
target's directory, so the link stays and its target is replaced), by the next `append`. Appends are durable when
`append` returns: the format's commit point (an fsync'd Arrow batch, the fsync'd `.coli_kv`
nrec word) has been written. A crash at any moment leaves a file that loads as a prefix of
what was appended, never a partial record.

Subclasses implement the byte format: `_read` (header + the good record prefix),
`_write_new` (a whole file, opened with O_TRUNC: it may exist already, made by keep_mode
with the permissions of the file it replaces; returns the format's state for it, which
`_adopt` installs only once the file has replaced the old one), `_append` (one durable
append at the current end), `_cut` (drop records after n, at a commit boundary the
subclass chooses).

A file with other hard links (st_nlink > 1: a snapshot made with `cp -al`, a user's `ln`)
shares its bytes with names that other locks guard (each name has its own sidecar lock,
slots.py), so kvfleet never writes into it in place: before its first in-place write (an
append, a cut, a self-heal) the writer copies it to a temp file beside it (beside a
symlink's target), fsyncs, renames it over the path and fsyncs the directory (`_detach`),
and writes into that copy; a whole-file rewrite replaces the path by a new file anyway.
Either way the other names keep exactly the bytes they had, and from then on the names are
separate files with separate locks. The writer logs it (once: the copy has one link) and
sets `detached` (workers/persist.py counts it as the "detached" cache event). A detach that
fails (disk full) removes its temp file and raises an OSError naming the file, with nothing
written: the file and its other names are as they were. Reading through any name is as
for any file.

Writers write in place only into the file they loaded or wrote (`open_loaded`): if its path
now names another file (one renamed over it without the slot lock), a write at the old
offsets would land inside that file, so it is an OSError instead. So is a write into a file
that no longer holds the bytes this writer committed (another program truncated it in
place): writing at the old offsets would leave a hole of zeros before the new bytes, which
a `.coli_kv` reader takes for records (token 0, zero codes) and after which an Arrow reader
drops the append that had just returned.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass


from kernels.tiers import Tier, get_tier
from kvstore.fingerprint import Fingerprint, HeaderError, LoadPlan, plan_load
from kvstore.records import KVRecords, RecordLayout, requantize, sanitize

log = logging.getLogger(__name__)


def file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def check_loaded(path: str, loaded: tuple[int, int] | None,
                 st: os.stat_result | None = None) -> None:
    """An OSError naming the file if `path` (or its stat `st`) is no longer the file whose
    file_id this writer took at load or write."""
    if file_id(st or os.stat(path)) != loaded:
        raise OSError(errno.ESTALE, f"{path}: replaced by another file since this writer loaded "
                                    f"it (another writer, e.g. kvfleet kv convert, renamed a file "
                                    f"over it); not writing at the old offsets")


def open_loaded(path: str, loaded: tuple[int, int] | None, flags: int, need: int = 0) -> int:
    """os.open(path, flags), if path still names the file `loaded` (check_loaded) and holds
    at least `need` bytes (the end of what this writer committed or keeps)."""
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        check_loaded(path, loaded, st)
        if st.st_size < need:
            raise OSError(errno.EIO, f"{path}: holds {st.st_size} bytes but this writer left "
                                     f"{need} there (another program truncated it since it was "
                                     f"loaded); not writing past its end, which would leave a "
                                     f"hole of zeros inside it")
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class FileContents:
    """What `_read` found: header words and the records up to the last good commit."""
    version: int
    tag: int
    fp: Fingerprint
    records: KVRecords | None  # the good prefix in the file's own tier; None if undecodable
    good_end: int  # byte offset where the good prefix ends
    file_size: int
    note: str | None = None  # e.g. what was cut from a torn tail


class CacheFile:
    """Base class; see the module docstring. Not thread-safe; one writer per file (slots.py)."""

    suffix = ""
    _file_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file loaded or written

    def __init__(self, path: str | os.PathLike, fp: Fingerprint, tier: Tier | str):
        self.path = os.fspath(path)
        self.fp, self.tier = fp, get_tier(tier)
        self.layout = RecordLayout(fp, self.tier)
        self.message: str | None = None
        self.plan: LoadPlan | None = None
        self._mode = "unloaded"  # new | replace | upgrade | append
        self._kept: KVRecords | None = None  # upgraded records awaiting their rewrite
        self._n = 0  # records on disk (append mode)
        self._heal_to: int | None = None
        self.detached = False  # a write gave this path a file of its own (hard links, above)
        self.legacy: str | None = None  # an older kvfleet's file of this slot, not read (slots.py)

    # ---- public ---------------------------------------------------------------------
    def load(self) -> KVRecords:
        """Read the file under the load rules; returns the records to resume from."""
        self._kept, self._heal_to, self._n, self.message, self.plan = None, None, 0, None, None
        if not os.path.exists(self.path):
            if os.path.islink(self.path):  # a loop, or a target that is gone (an unmounted share)
                raise unresolved_link(self.path)
            self._mode = "new"
            return self.layout.empty()
        check_regular(self.path)
        try:
            c = self._read()
        except HeaderError as e:
            return self._start_clean(f"{e}; starting clean; the next save replaces it")
        self.plan = plan_load(self.path, c.version, c.tag, c.fp, self.fp, self.tier)
        if self.plan.action == "reject":
            return self._start_clean(self.plan.message)
        recs = c.records
        notes = [c.note] if c.note else []
        if self.plan.action == "upgrade":
            recs = requantize(recs, self.plan.file_tier, self.tier, self.fp)
            self._mode, self._kept = "upgrade", recs
            notes.insert(0, self.plan.message)
        else:
            self._mode, self._n = "append", len(recs)
            if c.good_end < c.file_size:
                self._heal_to = c.good_end
        fixed = sanitize(self.tier, recs)
        if fixed:
            notes.append(f"{self.path}: {fixed} rows with invalid scales or codes zeroed")
        self._say(notes)
        return recs

    def append(self, recs: KVRecords, start: int | None = None) -> int:
        """Save records for positions [start, start + len(recs)); returns records on disk.

        start defaults to the current end; start < end first truncates (prefix shrank)."""
        if self._mode == "unloaded":
            self.load()
        self.layout.check(recs)
        end = self.length()
        start = end if start is None else start
        if not 0 <= start <= end:
            raise ValueError(f"{self.path}: append at record {start=} leaves a gap "
                             f"(the file holds {end} records)")
        if self._mode in ("new", "replace", "upgrade"):
            full = recs if self._kept is None or start == 0 else KVRecords.concat(
                [self._kept.slice(0, start), recs])
            self.rewrite(full)
            return self._n
        self._heal()
        if start < self._n:
            self._cut(start)
            self._n = start
        if len(recs):
            self._append(recs, self._n)
            self._n += len(recs)
        return self._n

    def truncate(self, n: int) -> None:
        """Keep only the first n records: durable on return for a file in the current
        format. A file being upgraded (or replaced) is only ever replaced whole, by the next
        append, so until then its old records stay on disk and a fresh load sees them again;
        each record carries its token, so reuse_prefix keeps only those that match."""
        if self._mode == "unloaded":
            self.load()
        if not 0 <= n <= self.length():
            raise ValueError(f"{self.path}: truncate to {n=} records, file holds {self.length()}")
        if self._mode == "upgrade":
            self._kept = self._kept.slice(0, n)
        elif self._mode == "append" and n < self._n:
            self._heal()
            self._cut(n)
            self._n = n

    def rewrite(self, recs: KVRecords) -> None:
        """Replace the whole file, atomically, by exactly `recs` (kv convert, compaction).
        If it fails before the rename, the file and this object are as they were."""
        self.layout.check(recs)
        self._replace(recs)

    def length(self) -> int:
        """Records that the next append continues from."""
        if self._mode == "upgrade":
            return len(self._kept)
        return self._n if self._mode == "append" else 0

    # ---- helpers --------------------------------------------------------------------
    def _start_clean(self, message: str) -> KVRecords:
        self._mode = "replace"
        self._say([message])
        return self.layout.empty()

    def _say(self, notes: list[str]) -> None:
        self.message = "; ".join(notes) if notes else None
        if self.message:
            log.warning("%s", self.message)

    def _heal(self) -> None:
        if self._heal_to is not None:
            fd = self._open_in_place(os.O_WRONLY, need=self._heal_to)  # (after a detach's log)
            log.warning("%s: self-heal: cutting torn tail at byte %d", self.path, self._heal_to)
            try:
                os.ftruncate(fd, self._heal_to)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._heal_to = None

    def _replace(self, recs: KVRecords) -> None:
        target = rewrite_target(self.path)  # a symlinked slot file: its target, not the link
        check_regular(target)
        tmp = f"{target}.tmp"  # one writer per file (slots.py), so a stale one is ours
        links = _links(target)
        try:
            keep_mode(target, tmp)
            state = self._write_new(tmp, recs)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        # the new file is in place: commit its state before anything else can fail
        self._mode, self._kept, self._n, self._heal_to = "append", None, len(recs), None
        self._adopt(state)
        if links > 1:
            self._detached(links, "replaced it by a file of its own")
        fsync_dir(target)

    def _open_in_place(self, flags: int, need: int = 0) -> int:
        """open_loaded(self.path, ...) for an in-place write, into a file of this path's own:
        one with other hard links is detached first (see the module docstring)."""
        fd = open_loaded(self.path, self._file_id, flags, need)
        links = os.fstat(fd).st_nlink
        if links > 1:
            os.close(fd)
            self._detach(links)
            fd = open_loaded(self.path, self._file_id, flags, need)
        return fd

    def _detach(self, links: int) -> None:
        """Replace the file, atomically, by a copy of its bytes (a new inode, one link), which
        this writer then owns: its state (offsets, record count, heal) holds for the copy."""
        target = rewrite_target(self.path)
        tmp = f"{target}.tmp"
        src = open_loaded(self.path, self._file_id, os.O_RDONLY)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.fstat(src).st_mode & 0o777)
            try:
                ident = file_id(os.fstat(fd))
                copy_into(src, fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except OSError as e:
            raise OSError(e.errno, f"{self.path}: has {links} hard links (other names share its "
                                   f"bytes, e.g. a `cp -al` snapshot); copying it to a file of its "
                                   f"own before writing failed ({e.strerror or e}); nothing "
                                   f"written: it and its other names hold what they held") from e
        finally:
            os.close(src)
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._file_id = ident
        self._detached(links, "copied it to a file of its own before writing")
        fsync_dir(target)

    def _detached(self, links: int, how: str) -> None:
        self.detached = True
        log.warning("%s: had %d hard links (other names shared its bytes, e.g. a `cp -al` "
                    "snapshot): %s, so the other names keep their bytes", self.path, links, how)

    # ---- format -----------------------------------------------------------------------
    def _read(self) -> FileContents:
        raise NotImplementedError

    def _write_new(self, path: str, recs: KVRecords) -> object:
        raise NotImplementedError

    def _adopt(self, state: object) -> None:
        """Take on `_write_new`'s state for the file that now holds exactly its records."""

    def _append(self, recs: KVRecords, start: int) -> None:
        raise NotImplementedError

    def _cut(self, n: int) -> None:
        raise NotImplementedError


def unresolved_link(path: str) -> OSError:
    """The error for a slot file that is a symlink which does not resolve (a loop, or a
    target on a share that is not mounted): neither read nor replaced."""
    return OSError(errno.ENOENT, f"{path}: a symlink to {os.readlink(path)!r} that does not "
                                 f"resolve; not starting a new cache in its place")


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


def check_regular(path: str) -> None:
    """An OSError naming `path` if it (or the end of its links) exists and is not a regular
    file: a FIFO would block the read forever (a worker's step with it), and a whole-file
    rewrite renames a new file over the path, which for a slot file linked to /dev/null
    would, run as root, replace the device node. Neither read nor replaced (the C engine's
    cache opener refuses them too, EINVAL)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # (nothing there, or a file in the way)
        return
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "of another kind")
        raise OSError(errno.EINVAL, f"{path}: is {kind}, not a regular file; not read as a KV "
                                    f"cache and never replaced")


def rewrite_target(path: str) -> str:
    """The file that a whole-file rewrite of `path` renames over: `path`, or, if it is a
    symlink (slot files linked onto shared storage), the file at the end of its chain of
    links, so that the temp file is made beside the target (same file system: the rename is
    atomic), the rename replaces the target and the link stays a link that now reads the
    new file. A link that does not resolve is an OSError (unresolved_link), as for load."""
    if not os.path.islink(path):
        return path
    if not os.path.exists(path):
        raise unresolved_link(path)
    return os.path.realpath(path)


def keep_mode(old: str, tmp: str) -> None:
    """Create `tmp` (empty) with the permission bits of the file `old` that it is to replace,
    if there is one, before it holds a byte: the tokens in a cache file are the conversation,
    and a file that its owner made private (chmod 600) must not come back world-readable
    from an upgrade, a clean start or a convert (the C engine rewrites it in place, which
    keeps them). fchmod, not the open's mode, so that the umask does not narrow them."""
    try:
        mode = stat.S_IMODE(os.stat(old).st_mode)
    except FileNotFoundError:
        return
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _links(path: str) -> int:
    """st_nlink of `path` (0 if it does not exist)."""
    try:
        return os.stat(path).st_nlink
    except FileNotFoundError:
        return 0


def copy_into(src: int, dst: int) -> None:
    """Copy fd `src` from its position to its end into fd `dst`."""
    while chunk := os.read(src, 1 << 20):
        write_all(dst, chunk)


def fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data) -> None:
    view = memoryview(data)
    if view.nbytes == 0:  # (cast refuses a view with a zero in its shape: no records)
        return
    view = view.cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]
