"""Whole-file writes that a crash cannot leave half done (`generate --stats`, `score --out`)."""
from __future__ import annotations

import os
import stat
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` as the file `path`: into a temporary file beside it (beside the end of
    its symlinks: the same file system), fsync'd, then renamed over it, so that a process
    killed mid-write leaves the old file or none, never a truncated one; the old file's
    permission bits are kept. A path that exists and is not a regular file (/dev/stdout,
    /dev/full, a FIFO) is written in place: a rename would replace the device node (as
    root) or the pipe. Raises OSError."""
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "wb") as f:
            f.write(data)
        return
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
