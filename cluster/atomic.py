"""Whole-file writes that a crash cannot leave half done (`generate --stats`, `score --out`)."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` as the file `path`: into a temporary file beside it (beside the end of
    its symlinks: the same file system), fsync'd, then renamed over it, so that a process
    killed mid-write leaves the old file or none, never a truncated one; the old file's
    permission bits are kept. One of the process's own descriptors (/dev/stdout, /dev/fd/N,
    /proc/self/fd/N) is written through it, at its offset, whatever it is (a pipe, or a
    file under `> file`, which a rename would have replaced, dropping all else printed);
    another path that is not a regular file (/dev/full, a FIFO) is written in place: a
    rename would replace the device node (as root) or the pipe. Raises OSError."""
    try:  # (stat follows /dev/stdout's link into /proc, which realpath cannot resolve)
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    if (fd := _descriptor(path)) is not None:  # (at its own offset, after what it has)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return
    if mode is not None and not stat.S_ISREG(mode):
        with open(path, "wb") as f:
            f.write(data)
        return
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), stat.S_IMODE(mode))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # (gone after the rename; a part left by a failed write)


def _descriptor(path: Path) -> int | None:
    """The descriptor of this process that `path` names (/dev/stdout, /dev/fd/N,
    /proc/self/fd/N), or None for a file."""
    p = os.path.abspath(path)
    std = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
    if p in std:
        return std[p]
    for prefix in ("/dev/fd/", "/proc/self/fd/", f"/proc/{os.getpid()}/fd/"):
        if p.startswith(prefix) and p[len(prefix):].isdigit():
            return int(p[len(prefix):])
    return None
