"""One results Parquet file (OUT or a part of it): written so that damage is detected on
reading, never misread.

The writer stores a CRC32 per data page (Parquet's page checksums) and, in the schema
metadata beside `kvfleet.settings`, `kvfleet.digest`: a blake2b digest of the settings
bytes and of every row's values, column by column (`rows_digest`). The reader verifies the
page checksums while decoding and recomputes the digest over what it decoded, so a flipped
bit in a data page, a page header, the footer or the metadata either fails to decode or
fails a check: of 300 random single-bit flips of a file, 65 read back as other rows with
no error before (and a resumed job carried such a row forward as done).

A file without a digest was written by an older kvfleet: it is read as before (its rows
cannot be checked), and the caller says so.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cluster.requests import LATER_COLUMNS, SCHEMA

SETTINGS_KEY = b"kvfleet.settings"
DIGEST_KEY = b"kvfleet.digest"
# what pyarrow may raise on a damaged file: its own errors (ArrowInvalid for a bad page,
# OSError for a checksum or a footer that does not parse, ArrowMemoryError for a length that
# decodes too big), and UnicodeDecodeError (a ValueError) for a column name that is not UTF-8
_READ_ERRORS = (OSError, pa.ArrowException, ValueError)


class ResultsFileError(Exception):
    """A results file that cannot be taken as it is: the message says what is wrong."""


@dataclass(frozen=True)
class ResultsFile:
    table: pa.Table  # the rows, as SCHEMA (columns added since the file was written: null)
    settings: dict | None  # its kvfleet.settings (None: written before they were recorded)
    checked: bool  # whether it had a digest (False: an older kvfleet's, read unchecked)


def write_results(table: pa.Table, path: Path, settings: dict | None) -> None:
    """`table` (SCHEMA) to `path` atomically: a temporary name, fsync'd, renamed into place."""
    meta = {} if settings is None else {SETTINGS_KEY: json.dumps(settings, sort_keys=True).encode()}
    meta[DIGEST_KEY] = rows_digest(table, meta.get(SETTINGS_KEY)).encode()
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table.replace_schema_metadata(meta), tmp, write_page_checksum=True)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_results(path: Path) -> ResultsFile:
    """The file's rows and settings, checked; ResultsFileError says what is wrong with it.
    The digest is checked over the columns as written, so a newer kvfleet's file with a
    column or a metadata key this one does not know still reads (without them); a file
    without a digest may carry other tools' keys (pandas' to_parquet adds `pandas`)."""
    try:
        raw = pq.read_table(path, page_checksum_verification=True)
        meta = raw.schema.metadata or {}
        digest = meta.get(DIGEST_KEY)
        if digest is None and (odd := [k for k in meta if _ours_damaged(k)]):
            # (a flipped bit in the digest's own name would pass the file as unchecked)
            raise ResultsFileError(f"cannot read earlier results (schema metadata key "
                                   f"{odd[0]!r:.60} is not one kvfleet writes: the file is "
                                   f"damaged)")
        if digest is not None and digest != rows_digest(raw, meta.get(SETTINGS_KEY)).encode():
            raise ResultsFileError("cannot read earlier results (its rows do not match the "
                                   "digest it was written with: the file is damaged)")
        table = _as_results(raw, digest is not None)
    except _READ_ERRORS as e:  # (a damaged column name is not UTF-8: a ValueError too)
        raise ResultsFileError(f"cannot read earlier results ({_one_line(e)})") from None
    settings = meta.get(SETTINGS_KEY)
    if settings is not None:
        try:
            settings = json.loads(settings)
        except ValueError:  # (JSONDecodeError, UnicodeDecodeError: an unchecked file only)
            raise ResultsFileError("cannot read earlier results (its kvfleet.settings metadata "
                                   "is not JSON: the file is damaged)") from None
    return ResultsFile(table, settings, digest is not None)


def _ours_damaged(key: bytes) -> bool:
    """A metadata key that is not one kvfleet writes but is close to one (or in its
    namespace): a damaged name."""
    if key in (SETTINGS_KEY, DIGEST_KEY):
        return False
    return key.startswith(b"kvfleet") or any(
        difflib.SequenceMatcher(None, key, ours).ratio() >= 0.8 for ours in (SETTINGS_KEY, DIGEST_KEY))


def _as_results(raw: pa.Table, checked: bool) -> pa.Table:
    missing = set(SCHEMA.names) - set(raw.column_names)
    if missing and checked:  # (this kvfleet writes every column: a name is damaged)
        raise ResultsFileError(f"cannot read earlier results (column {sorted(missing)[0]!r} "
                               f"is missing: the file is damaged)")
    if missing - LATER_COLUMNS:
        raise ResultsFileError(f"not a kvfleet results file (missing {sorted(missing)})")
    for name in sorted(missing):  # written before that column existed
        raw = raw.append_column(SCHEMA.field(name), pa.nulls(raw.num_rows, SCHEMA.field(name).type))
    return raw.select(SCHEMA.names).cast(SCHEMA)


def rows_digest(table: pa.Table, settings: bytes | None) -> str:
    """A digest of the values of `table` (and of the settings bytes), independent of how the
    columns are chunked or laid out in memory: the same rows read back give the same one."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, b"" if settings is None else settings)
    _feed(h, str(table.num_rows).encode())
    for name, col in zip(table.column_names, table.columns):
        _feed(h, f"{name}:{_type_name(col.type)}".encode())
        _feed_array(h, col.combine_chunks())
    return h.hexdigest()


def _type_name(t: pa.DataType) -> str:
    """The type without a list's item name (Parquet reads list<item> back as list<element>
    where no Arrow schema says otherwise)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_type_name(t.value_type)}>"
    return str(t)


def _feed(h, data) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def _feed_array(h, a: pa.Array) -> None:
    """Validity, then the values: lengths and the flattened items of a list, lengths and
    bytes of a string, the numbers of a primitive (null slots as zero or empty)."""
    _feed(h, np.asarray(a.is_valid().to_numpy(zero_copy_only=False), np.uint8).tobytes())
    if pa.types.is_list(a.type) or pa.types.is_large_list(a.type):
        _feed(h, pc.list_value_length(a).fill_null(0).to_numpy(zero_copy_only=False).tobytes())
        _feed_array(h, a.flatten())  # (the items of the valid lists only)
    elif pa.types.is_string(a.type) or pa.types.is_binary(a.type):
        b = a.cast(pa.large_binary()).fill_null(b"")
        if len(b):  # (offsets: int64 [len + 1] from b.offset; the bytes between the ends)
            offsets = np.frombuffer(b.buffers()[1], np.int64)[b.offset:b.offset + len(b) + 1]
            _feed(h, np.diff(offsets).tobytes())
            _feed(h, memoryview(b.buffers()[2])[offsets[0]:offsets[-1]])
    else:
        _feed(h, a.fill_null(0).to_numpy(zero_copy_only=False).tobytes())


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
