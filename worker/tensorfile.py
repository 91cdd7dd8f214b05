"""Safetensors files without torch: raw little-endian buffers as numpy arrays.

bf16 has no numpy dtype, so bf16 tensors are held as ``uint16`` arrays and written with the
``bfloat16`` tag; the bytes are exactly the ones the hook wrote. Uses the safetensors
library's own serializer and parser.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, TensorSpec, deserialize, serialize_file

from worker.errors import Corrupt

# safetensors dtype tag -> (numpy dtype holding the raw bytes, name used when writing)
_DTYPES: dict[str, tuple[np.dtype, str]] = {
    "BF16": (np.dtype("<u2"), "bfloat16"),
    "I64": (np.dtype("<i8"), "int64"),
    "I32": (np.dtype("<i4"), "int32"),
    "U8": (np.dtype("u1"), "uint8"),
    "F32": (np.dtype("<f4"), "float32"),
}


@dataclass
class Tensor:
    """A tensor's raw data: ``array`` holds the bytes (bf16 as uint16); ``dtype`` the file tag."""

    dtype: str  # "BF16", "I64", ...
    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


@dataclass
class TensorFile:
    tensors: dict[str, Tensor]
    metadata: dict[str, str]
    size_bytes: int


def read(path: Path, drop_cache: bool = False) -> TensorFile:
    """Read and parse a whole file.

    Args:
        drop_cache: evict the file's pages first, so the bytes come from the disk, not from
            the page cache (used to verify what was written).

    Raises:
        Corrupt: the file is not a well-formed safetensors file.
        OSError: the file cannot be opened or read.
    """
    with open(path, "rb") as f:
        if drop_cache:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        raw = f.read()
    try:
        parsed = deserialize(raw)
    except (SafetensorError, ValueError) as e:
        raise Corrupt(f"{path.name}: not a valid safetensors file: {e}") from e
    # the header deserialize just validated: 8-byte length, then JSON (no second open)
    header_len = int.from_bytes(raw[:8], "little")
    metadata = dict(json.loads(raw[8 : 8 + header_len]).get("__metadata__") or {})
    tensors = {}
    for name, t in parsed:
        dtype, data, shape = str(t["dtype"]), t["data"], t["shape"]
        if dtype not in _DTYPES:
            raise Corrupt(f"{path.name}: tensor {name} has unsupported dtype {dtype}")
        assert isinstance(data, bytes | bytearray) and isinstance(shape, list)
        tensors[name] = Tensor(dtype, np.frombuffer(data, dtype=_DTYPES[dtype][0]).reshape(shape))
    return TensorFile(tensors, metadata, len(raw))


def write(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file (no fsync, no rename: the caller owns durability)."""
    arrays = {k: np.ascontiguousarray(t.array) for k, t in tensors.items()}
    specs = {
        k: TensorSpec(dtype=_DTYPES[t.dtype][1], shape=list(arrays[k].shape),
                      data_ptr=arrays[k].ctypes.data, data_len=arrays[k].nbytes)
        for k, t in tensors.items()
    }
    serialize_file(specs, str(path), metadata=metadata)


@dataclass(frozen=True)
class Header:
    """A file's header only: metadata, tensor shapes, the file's size. No tensor data read."""

    metadata: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    size_bytes: int


_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def read_header(path: Path) -> Header:
    """Parse the 8-byte length and JSON header. Raises Corrupt or OSError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise Corrupt(f"{path.name}: not a valid safetensors file: header length {n}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        meta = {str(k): str(v) for k, v in (header.pop("__metadata__", None) or {}).items()}
        shapes = {str(k): tuple(int(x) for x in v["shape"]) for k, v in header.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise Corrupt(f"{path.name}: not a valid safetensors file: bad header ({e})") from e
    return Header(meta, shapes, size)


def header_metadata(path: Path) -> dict[str, str]:
    """Only the metadata (reads the header, not the data). Raises Corrupt or OSError."""
    return read_header(path).metadata


def bf16_nonfinite(arr: np.ndarray) -> int:
    """How many bf16 values (held as uint16) are NaN or ±Inf: exponent bits all ones."""
    return int(np.count_nonzero((arr & 0x7F80) == 0x7F80))
