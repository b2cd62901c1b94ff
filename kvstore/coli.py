"""The C engine's raw `.coli_kv` cache file, read and written byte-compatibly.

    offset  size  field
    0       8     magic "COLIKV1\\0" (f32) | "COLIKV2\\0" (kv8) | "COLIKV3\\0" (tq / polar)
    8       4     int32 n_layers          (all header words little-endian int32)
    12      4     int32 kv_lora
    16      4     int32 rope
    20      4     int32 index_hd          (0 without DSA)
    24      4     int32 n_indexer_layers
    28      4     int32 vocab
    32      4     int32 nrec              the commit word: records [0, nrec) are valid
    36      4     int32 tag               0 f32, 1 kv8, v3: codec << 8 | bits
    40      ...   nrec records, each RecordLayout.record_bytes (kvstore/records.py):
                  int32 token; per layer L codes [f32 L scale] R codes [f32 R scale];
                  per indexer layer index_hd float32

The writer appends records after the last committed one, fsyncs, then writes nrec and
fsyncs again, so a crash leaves at most uncommitted bytes past nrec, which the next open
for writing cuts off. A reader stops at the first short record (nrec = records read).
"""
from __future__ import annotations

import errno
import os
import struct

import numpy as np

from kvstore.cachefile import CacheFile, FileContents, file_id, write_all
from kernels.tiers import TierError, tier_from_tag
from kvstore.fingerprint import Fingerprint, HeaderError
from kvstore.records import KVRecords, RecordLayout

MAGICS = {b"COLIKV1\0": 1, b"COLIKV2\0": 2, b"COLIKV3\0": 3}
HEADER_BYTES = 40
NREC_OFFSET = 32


def header_bytes(version: int, fp: Fingerprint, nrec: int, tag: int) -> bytes:
    magic = next(m for m, v in MAGICS.items() if v == version)
    return magic + struct.pack("<8i", *fp.words(), nrec, tag)


def read_header(path: str) -> tuple[int, Fingerprint, int, int, int]:
    """(version, fingerprint, nrec, tag, file size); HeaderError naming the file otherwise."""
    with open(path, "rb") as f:
        return parse_header(f.read(HEADER_BYTES), os.fstat(f.fileno()).st_size, path)


def parse_header(head: bytes, size: int, path: str) -> tuple[int, Fingerprint, int, int, int]:
    """read_header from the file's first HEADER_BYTES bytes and its size."""
    if head[:6] != b"COLIKV" or head[:8] not in MAGICS:
        raise HeaderError(f"{path}: not a .coli_kv cache (magic {head[:8]!r}, want "
                          f"b'COLIKV1\\x00'/b'COLIKV2\\x00'/b'COLIKV3\\x00')")
    if len(head) < HEADER_BYTES:
        raise HeaderError(f"{path}: .coli_kv header truncated ({size} bytes, need {HEADER_BYTES})")
    h = struct.unpack("<8i", head[8:])
    fp = Fingerprint.from_words(h[:6], path)
    if h[6] < 0:
        raise HeaderError(f"{path}: impossible header: nrec={h[6]} is negative")
    return MAGICS[head[:8]], fp, h[6], h[7], size


class ColiKVFile(CacheFile):
    suffix = ".coli_kv"
    _fix_nrec: int | None = None  # set by _read when the commit word must be rewritten

    def _read(self) -> FileContents:
        # one open file for the id, the header and the records: a file renamed over the
        # path meanwhile (the C engine rewriting it) is read whole or not at all, never a
        # header of one file with the records of another
        with open(self.path, "rb") as fh:
            st = os.fstat(fh.fileno())
            self._file_id = file_id(st)
            version, fp, nrec, tag, size = parse_header(fh.read(HEADER_BYTES), st.st_size, self.path)
            return self._contents(fh, version, fp, nrec, tag, size)

    def _contents(self, fh, version: int, fp: Fingerprint, nrec: int, tag: int,
                  size: int) -> FileContents:
        c = FileContents(version, tag, fp, None, HEADER_BYTES, size)
        self._fix_nrec = None
        try:
            layout = RecordLayout(fp, tier_from_tag(version, tag))
        except TierError:
            return c  # unknown tier: plan_load rejects it before the records are needed
        rec = layout.record_bytes
        whole = (size - HEADER_BYTES) // rec
        n = min(nrec, whole)
        if n < nrec:
            c.note = (f"{self.path}: header says {nrec} records but only {n} are complete; "
                      f"keeping {n}")
        elif HEADER_BYTES + n * rec < size:
            c.note = (f"{self.path}: {size - HEADER_BYTES - n * rec} uncommitted bytes after record "
                      f"{n} (cut at the next write)")
        data = np.empty(n * rec, np.uint8)  # writable: the records are views into it
        got = fh.readinto(data)  # (fh is at HEADER_BYTES)
        if got != data.size:  # the file shrank since its fstat: cut in place while loading
            raise OSError(errno.EIO, f"{self.path}: read {got} of the {data.size} record bytes "
                                     f"its size promised (truncated while being loaded)")
        c.records = layout.views(data)
        c.good_end = HEADER_BYTES + n * rec
        if n < nrec or c.good_end < size:
            self._fix_nrec = n  # the heal also rewrites the commit word
        return c

    def _heal(self) -> None:
        fix = self._fix_nrec  # wrong nrec, with or without torn bytes after the last record
        rec = self.layout.record_bytes
        if fix is not None:
            fd = self._open_in_place(os.O_RDWR, need=HEADER_BYTES + fix * rec)
            try:
                os.pwrite(fd, struct.pack("<i", fix), NREC_OFFSET)
                os.fsync(fd)
            finally:
                os.close(fd)
        self._fix_nrec = None
        super()._heal()

    def _write_new(self, path: str, recs: KVRecords) -> tuple[int, int]:
        t = self.tier
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            ident = file_id(os.fstat(fd))
            write_all(fd, header_bytes(t.version, self.fp, len(recs), t.tag))
            write_all(fd, self.layout.pack(recs))
            os.fsync(fd)
        finally:
            os.close(fd)
        return ident

    def _adopt(self, ident: tuple[int, int]) -> None:
        self._fix_nrec, self._file_id = None, ident  # the new file's nrec is right

    def _append(self, recs: KVRecords, start: int) -> None:
        at = HEADER_BYTES + start * self.layout.record_bytes
        fd = self._open_in_place(os.O_RDWR, need=at)
        try:
            os.lseek(fd, at, os.SEEK_SET)
            write_all(fd, self.layout.pack(recs))
            os.fsync(fd)
            os.pwrite(fd, struct.pack("<i", start + len(recs)), NREC_OFFSET)  # the commit
            os.fsync(fd)
        finally:
            os.close(fd)

    def _cut(self, n: int) -> None:
        fd = self._open_in_place(os.O_RDWR, need=HEADER_BYTES + n * self.layout.record_bytes)
        try:
            os.pwrite(fd, struct.pack("<i", n), NREC_OFFSET)  # commit the shorter length first
            os.fsync(fd)
            os.ftruncate(fd, HEADER_BYTES + n * self.layout.record_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)

