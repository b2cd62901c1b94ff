"""Reading and writing .safetensors files with numpy only (no code from the checkpoint runs).

Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets count from the
byte after the header. We parse the header ourselves so that bf16 (which numpy lacks) reads
as float32 and a file shorter than its header promises is reported, naming file and tensor.
The header is checked as strictly as the reference `safetensors` library checks it: shapes and
offsets are non-negative ints, and the tensors tile the data section with no overlap or gap.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np


class WeightsError(ValueError):
    """A checkpoint that cannot be loaded: names the file and tensor, with expected vs found."""


# dtype tag -> (numpy storage dtype, bytes per element)
DTYPES = {"BF16": (np.dtype("<u2"), 2), "F16": (np.dtype("<f2"), 2), "F32": (np.dtype("<f4"), 4),
          "F64": (np.dtype("<f8"), 8)}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes lie; `read()` returns it as float32."""
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    def read(self) -> np.ndarray:
        storage, _ = DTYPES[self.dtype]
        count = math.prod(self.shape)
        raw = np.memmap(self.file, dtype=storage, mode="r", offset=self.offset, shape=(count,))
        if self.dtype == "BF16":  # bf16 is the high half of a float32
            out = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            out = raw.astype(np.float32)
        return out.reshape(self.shape)


def read_header(path: Path) -> dict[str, TensorRef]:
    """Parse and check a .safetensors header; every tensor must lie inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise WeightsError(f"{path}: truncated safetensors file: header says {n} header bytes, "
                               f"file has {size - 8} after the length")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: safetensors header is not a JSON object")
    refs: dict[str, TensorRef] = {}
    spans: list[tuple[int, int, str]] = []  # (begin, end, name) in the data section
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError):
            raise WeightsError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if not _counts(shape) or not _counts(offsets) or len(offsets) != 2:
            raise WeightsError(f"{path}: tensor {name!r} needs shape and data_offsets [begin, end] of "
                               f"non-negative ints, header gives shape={shape!r} data_offsets={offsets!r}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WeightsError(f"{path}: tensor {name!r} has dtype {dtype!r}; supported: {sorted(DTYPES)}")
        shape, (begin, end) = tuple(shape), offsets
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        if end - begin != nbytes:
            raise WeightsError(f"{path}: tensor {name!r} {dtype}{list(shape)} needs {nbytes} bytes, "
                               f"header gives data_offsets [{begin}, {end}]")
        if 8 + n + end > size:
            raise WeightsError(f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                               f"{8 + n + end}, file has {size} bytes")
        refs[name] = TensorRef(path, name, dtype, shape, 8 + n + begin, nbytes)
        spans.append((begin, end, name))
    _check_tiling(path, sorted(spans), size - 8 - n)
    return refs


def _counts(v) -> bool:
    """A JSON list of non-negative ints (bools, floats and strings are not counts)."""
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def _check_tiling(path: Path, spans: list[tuple[int, int, str]], data_len: int) -> None:
    """The tensors, sorted by offset, must cover the data section [0, data_len) exactly once
    (as the reference safetensors library requires): no overlap, no gap, nothing after."""
    pos, prev = 0, None
    for begin, end, name in spans:
        if begin < pos:
            raise WeightsError(f"{path}: tensor {name!r} data_offsets [{begin}, {end}] overlap tensor "
                               f"{prev!r}, which ends at {pos}")
        if begin > pos:
            after = "the start of the data" if prev is None else f"tensor {prev!r}"
            raise WeightsError(f"{path}: tensor {name!r} starts at data offset {begin}, leaving a gap of "
                               f"{begin - pos} bytes after {after} (at {pos})")
        pos, prev = end, name
    if pos != data_len:
        last = "no tensor" if prev is None else f"the last tensor {prev!r}"
        raise WeightsError(f"{path}: {data_len - pos} unused bytes after {last} (data section has "
                           f"{data_len} bytes, tensors cover {pos})")


def save_file(path: Path, tensors: dict[str, np.ndarray], dtype: str = "BF16",
              metadata: dict[str, str] | None = None) -> None:
    """Write float tensors as one .safetensors file in `dtype` (bf16 rounds to nearest even)."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    blobs, pos = [], 0
    for name, arr in tensors.items():
        arr = np.asarray(arr, dtype=np.float32)
        if dtype == "BF16":
            data = arr.astype(ml_dtypes.bfloat16).tobytes()
        else:
            data = arr.astype(DTYPES[dtype][0]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for b in blobs:
            f.write(b)
