"""kvfleet's on-disk KV cache: an append-only Arrow IPC *stream* file.

The file is a schema message followed by one record batch message per append, each
fsync'd; there is no end-of-stream marker (the stream is never closed, only appended to),
so `pyarrow.ipc.open_stream` reads it as is, and pandas/polars can read it for analysis.

Schema (two non-null columns, one row per cached token):

    token   int32
    record  fixed_size_binary(record_bytes - 4): the record of kvstore/records.py minus its
            token, i.e. per layer L codes, [f32 L scale], R codes, [f32 R scale] (scales for
            v2/v3 only), then per indexer layer index_hd float32; all little-endian. These
            are the `.coli_kv` record bytes, so conversion is a byte copy.

Schema metadata (utf-8 strings):

    kvfleet.kv_cache      "arrow-1" (this container's layout version)
    kvfleet.version       "1" f32 | "2" kv8 | "3" tq/polar (the .coli_kv magic number)
    kvfleet.tag           the .coli_kv tag: 0 f32, 1 kv8, codec << 8 | bits for v3
    kvfleet.tier          tier name (informational; version + tag decide)
    kvfleet.fingerprint   JSON {n_layers, kv_lora, rope, index_hd, n_indexer_layers, vocab}
    kvfleet.record_bytes  bytes of one full record (token included)

Batch custom metadata (in each batch's IPC message):

    kvfleet.start   index of the batch's first record; must equal the records before it
    kvfleet.crc32   zlib.crc32 of: int64 start, int64 num_rows (little-endian), the token
                    column's bytes, the record column's bytes

Reading keeps batches while they decode, have rows, continue the record count, lie in the
file's bytes as written (not decompressed or byte-swapped elsewhere) and match their crc;
the first one that does not (a torn write, a flipped byte) ends the good prefix, and the
next open for writing truncates the file there (self-heal). A schema that does not decode
or is not native-endian is a HeaderError (clean start). Loaded records are strided views
into the file's bytes (no per-record copy). pyarrow's stream writer has no
"batch only" mode, so appends stream it through `_BatchSink`, which drops the schema
message it writes first and the end-of-stream marker it writes on close.
"""
from __future__ import annotations

import errno
import json
import os
import struct
import zlib
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from kernels.tiers import TierError, tier_from_tag
from kvstore.cachefile import CacheFile, FileContents, check_loaded, file_id, write_all
from kvstore.fingerprint import FIELDS, Fingerprint, HeaderError
from kvstore.records import KVRecords, RecordLayout

CONTAINER = "arrow-1"
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def make_schema(version: int, tag: int, tier_name: str, fp: Fingerprint, record_bytes: int) -> pa.Schema:
    meta = {"kvfleet.kv_cache": CONTAINER, "kvfleet.version": str(version),
            "kvfleet.tag": str(tag), "kvfleet.tier": tier_name,
            "kvfleet.fingerprint": json.dumps(dict(zip(FIELDS, fp.words()))),
            "kvfleet.record_bytes": str(record_bytes)}
    return pa.schema([pa.field("token", pa.int32(), nullable=False),
                      pa.field("record", pa.binary(record_bytes - 4), nullable=False)], metadata=meta)


def parse_schema(schema: pa.Schema, path: str) -> tuple[int, int, Fingerprint, int]:
    """(version, tag, fingerprint, record_bytes) from a kvfleet schema; HeaderError otherwise."""
    meta = {k.decode(errors="replace"): v.decode(errors="replace")
            for k, v in (schema.metadata or {}).items()}
    if meta.get("kvfleet.kv_cache") != CONTAINER:
        raise HeaderError(f"{path}: an Arrow stream but not a kvfleet KV cache "
                          f"(kvfleet.kv_cache={meta.get('kvfleet.kv_cache')!r})")
    try:
        version, tag = int(meta["kvfleet.version"]), int(meta["kvfleet.tag"])
        fpd = json.loads(meta["kvfleet.fingerprint"])
        words = [fpd[k] for k in FIELDS]
        record_bytes = int(meta["kvfleet.record_bytes"])
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise HeaderError(f"{path}: KV cache schema metadata unreadable ({e!r})") from None
    try:
        names = [f.name for f in schema]
    except UnicodeDecodeError as e:
        raise HeaderError(f"{path}: KV cache column names are not UTF-8 ({e})") from None
    # pyarrow exposes no Schema.endianness, but Schema.equals compares it and a schema rebuilt
    # from the fields is native; _open keeps a non-native schema as written (no byte swap).
    if not schema.equals(pa.schema(list(schema), metadata=schema.metadata)):
        raise HeaderError(f"{path}: KV cache schema is not native-endian (a kvfleet writer "
                          f"never writes that: corrupt header)")
    fp = Fingerprint.from_words(words, path)
    rtype = schema.field(1).type if len(names) == 2 else None
    ok = (record_bytes > 4 and names == ["token", "record"] and schema.field(0).type == pa.int32()
          and pa.types.is_fixed_size_binary(rtype) and rtype.byte_width == record_bytes - 4)
    if not ok:
        raise HeaderError(f"{path}: KV cache columns {schema.types} do not match "
                          f"record_bytes={record_bytes}")
    return version, tag, fp, record_bytes


def read_header(path: str) -> tuple[int, int, Fingerprint, int]:
    """(version, tag, fingerprint, record_bytes) of an Arrow KV cache; HeaderError otherwise."""
    with pa.memory_map(path) as src:
        return parse_schema(_open(src, path).schema, path)


def _open(src, path: str) -> ipc.RecordBatchStreamReader:
    try:  # not native-endian: keep the buffers in place for parse_schema to reject
        return ipc.open_stream(src, options=ipc.IpcReadOptions(ensure_native_endian=False))
    except (pa.ArrowException, OSError) as e:
        raise HeaderError(f"{path}: not an Arrow IPC stream KV cache ({e})") from None


def batch_crc(start: int, tokens: np.ndarray, payload: np.ndarray) -> int:
    crc = zlib.crc32(struct.pack("<qq", start, len(tokens)))
    return zlib.crc32(payload, zlib.crc32(tokens, crc))


class ArrowKVFile(CacheFile):
    suffix = ".arrow"

    @cached_property
    def schema(self) -> pa.Schema:
        t = self.tier
        return make_schema(t.version, t.tag, t.name, self.fp, self.layout.record_bytes)

    @cached_property
    def _schema_message(self) -> bytes:
        sink = pa.BufferOutputStream()
        ipc.new_stream(sink, self.schema).close()
        data = sink.getvalue().to_pybytes()
        assert data.endswith(_EOS)
        return data[:-len(_EOS)]

    def _write_batch(self, fd: int, recs: KVRecords, start: int) -> int:
        """Write one batch message (no schema, no EOS) at fd's position; returns its bytes."""
        n, width = len(recs), self.layout.record_bytes - 4
        tokens = np.ascontiguousarray(recs.tokens, np.int32)
        payload = self.layout.pack(recs, with_token=False)
        # from_buffers, not pa.array: pa.array would import pandas (seconds) to sniff the input
        token = pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(tokens)])
        record = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(payload)])
        batch = pa.RecordBatch.from_arrays([token, record], schema=self.schema)
        meta = {"kvfleet.start": str(start), "kvfleet.crc32": str(batch_crc(start, tokens, payload))}
        sink = _BatchSink(fd, self._schema_message)
        with ipc.new_stream(pa.PythonFile(sink, mode="w"), self.schema) as w:
            w.write_batch(batch, custom_metadata=meta)
            sink.finish()
        return sink.written

    def _read(self) -> FileContents:
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            data = np.empty(st.st_size, np.uint8)  # writable: the records are views into it
            got = f.readinto(data)
        self._file_id = file_id(st)
        data = data[:got]
        src = pa.BufferReader(pa.py_buffer(data))
        reader = _open(src, self.path)
        version, tag, fp, rec = parse_schema(reader.schema, self.path)
        c = FileContents(version, tag, fp, None, src.tell(), got)
        self._bounds = [(0, c.good_end)]  # (records, byte offset) at each commit
        toks, pays, n, why = [], [], 0, None
        while True:
            try:
                batch, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                break
            except (pa.ArrowException, OSError) as e:
                why = f"unreadable batch ({str(e).splitlines()[0][:120]})"
                break
            tok, pay, why = _check_batch(batch, meta, n, rec, data)
            if tok is None:
                break
            toks.append(tok)
            pays.append(pay)
            n += len(tok)
            self._bounds.append((n, src.tell()))
        c.good_end = self._bounds[-1][1]
        try:
            layout = RecordLayout(fp, tier_from_tag(version, tag))
        except TierError:
            return c  # plan_load rejects it before the records are needed
        if layout.record_bytes != rec:
            raise HeaderError(f"{self.path}: kvfleet.record_bytes={rec} but {layout.tier.name} "
                              f"records of {fp.describe()} take {layout.record_bytes} bytes")
        one = len(pays) == 1  # a single batch is used in place, several are joined
        c.records = layout.views(pays[0] if one else np.concatenate(pays or [data[:0]]),
                                 tokens=toks[0] if one else np.concatenate(toks or [np.zeros(0, np.int32)]))
        if c.good_end < c.file_size:
            c.note = (f"{self.path}: torn or corrupt tail after record {n} "
                      f"({c.file_size - c.good_end} bytes from byte {c.good_end}"
                      f"{': ' + why if why else ''}); kept {n} records")
        return c

    def _write_new(self, path: str, recs: KVRecords) -> tuple[list, tuple[int, int]]:
        """Write a whole file; returns its commit bounds and file_id (for `_adopt`, once it
        is in place)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            ident = file_id(os.fstat(fd))
            head = self._schema_message
            write_all(fd, head)
            bounds = [(0, len(head))]
            if len(recs):
                size = self._write_batch(fd, recs, 0)
                bounds.append((len(recs), len(head) + size))
            os.fsync(fd)
        finally:
            os.close(fd)
        return bounds, ident

    def _adopt(self, state: tuple[list, tuple[int, int]]) -> None:
        self._bounds, self._file_id = state

    def _append(self, recs: KVRecords, start: int) -> None:
        end = self._bounds[-1][1]
        fd = self._open_in_place(os.O_WRONLY, need=end)
        try:
            os.lseek(fd, end, os.SEEK_SET)
            size = self._write_batch(fd, recs, start)
            os.fsync(fd)  # the commit: a complete batch with a matching crc
        finally:
            os.close(fd)
        self._bounds.append((start + len(recs), end + size))

    def _cut(self, n: int) -> None:
        """Keep records [0, n). A cut inside a batch writes the kept part of that batch as a
        new batch over its start, then truncates after it: rewriting bytes the file already
        holds takes no new space, so on a full disk (a shared one that others fill as soon as
        a truncate frees blocks) the kept records are not lost, as they were when the file
        was truncated first and the kept part appended after."""
        keep = max(i for i, (recs, _) in enumerate(self._bounds) if recs <= n)
        recs_at, byte_at = self._bounds[keep]
        check_loaded(self.path, self._file_id)  # before _read takes the path's file_id again
        tail = self._read().records.slice(recs_at, n) if recs_at < n else None  # part of a batch
        if tail is not None and len(tail) != n - recs_at:
            raise OSError(errno.EIO, f"{self.path}: records {recs_at}..{n} read back short "
                                     f"({len(tail)}): the file changed since it was loaded")
        fd = self._open_in_place(os.O_WRONLY, need=byte_at)
        size = 0
        try:
            if tail is not None:
                os.lseek(fd, byte_at, os.SEEK_SET)
                size = self._write_batch(fd, tail, recs_at)
            os.ftruncate(fd, byte_at + size)
            os.fsync(fd)
        except BaseException:
            # the batch after record recs_at may be half overwritten: the file holds recs_at
            # records for sure, and the next write first cuts it there
            self._bounds, self._n, self._heal_to = self._bounds[:keep + 1], recs_at, byte_at
            raise
        finally:
            os.close(fd)
        self._bounds = self._bounds[:keep + 1] + ([(n, byte_at + size)] if size else [])
        self._n = n


def _check_batch(batch, meta, n: int, rec: int, data: np.ndarray):
    """(tokens, payload) of a good batch as views into `data` (the file's bytes), or
    (None, None, why)."""
    try:
        start, crc = int(meta[b"kvfleet.start"]), int(meta[b"kvfleet.crc32"])
    except (KeyError, TypeError, ValueError):
        return None, None, "batch without kvfleet.start/crc32"
    if start != n:
        return None, None, f"batch kvfleet.start={start}, expected {n}"
    tok, col = batch.column(0), batch.column(1)
    if tok.null_count or col.null_count or col.type.byte_width != rec - 4:
        return None, None, "batch with nulls or wrong record width"
    rows, (tbuf, pbuf) = batch.num_rows, (tok.buffers()[1], col.buffers()[1])
    if rows == 0:
        return None, None, "empty batch (kvfleet never writes one)"
    if (tbuf is None or pbuf is None or tbuf.size < (tok.offset + rows) * 4
            or pbuf.size < (col.offset + rows) * (rec - 4)):
        return None, None, "batch buffers shorter than its row count"
    tokens = _inside(data, tbuf.address + tok.offset * 4, rows * 4)
    payload = _inside(data, pbuf.address + col.offset * (rec - 4), rows * (rec - 4))
    if tokens is None or payload is None:  # e.g. a compressed body, decoded into new memory
        return None, None, "batch buffers outside the file data"
    tokens = tokens.view(np.int32)
    if batch_crc(start, tokens, payload) != crc:
        return None, None, "checksum mismatch"
    return tokens, payload, None


def _inside(data: np.ndarray, address: int, nbytes: int) -> np.ndarray | None:
    """The writable slice of `data` at a pyarrow buffer address (zero-copy reads point into
    the buffer the reader was given), or None if the buffer is not inside `data`."""
    off = address - data.ctypes.data
    return data[off:off + nbytes] if 0 <= off <= data.size - nbytes else None


class _BatchSink:
    """A file object for pa.PythonFile that forwards a stream writer's output to an fd,
    minus the schema message it writes first and the end-of-stream marker it writes on
    close: what is left is exactly one record batch message."""

    def __init__(self, fd: int, schema_message: bytes):
        self.fd, self.head, self.seen, self.written, self.done = fd, schema_message, 0, 0, False
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        skip = max(0, min(n, len(self.head) - self.seen))
        if skip and view[:skip] != self.head[self.seen:self.seen + skip]:
            raise RuntimeError("Arrow stream writer emitted an unexpected schema message")
        self.seen += n
        rest = view[skip:]
        if self.done:  # after the batch: only the end-of-stream marker may follow
            if bytes(rest) not in (b"", _EOS, _EOS[:4], _EOS[4:]):
                raise RuntimeError("Arrow stream writer emitted bytes after the batch")
        elif len(rest):
            write_all(self.fd, rest)
            self.written += len(rest)
        return n

    def finish(self) -> None:
        self.done = True

    def tell(self) -> int:
        return self.seen

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
