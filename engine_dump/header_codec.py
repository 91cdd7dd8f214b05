"""The safetensors header, read and built without torch: ``u64 length | JSON | data``.

The one codec of the hook and the farm (the hook's dumps, weights identity and probe; the
worker's ``tensorfile``; model shards' final norm; training's sample files). It splits and
builds the bytes only; each reader keeps its own checks and error (a dump, a final file, a
model shard and a training file are refused for different reasons). Here because the hook
needs it and imports nothing of the farm. Tests: tests/unit/test_tensorfile.py, test_rids.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
TAG_BYTES = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "I64": 8, "I32": 4, "U8": 1}
# the order the safetensors library lays tensors out in: wider dtypes first, then by name
_LAYOUT_RANK = {"I64": 0, "F32": 1, "I32": 2, "BF16": 3, "F8_E4M3": 4, "U8": 5}


def length(first8: bytes) -> int:
    """The JSON header's length, from a file's first 8 bytes (at least 8 of them)."""
    return int.from_bytes(first8[:8], "little")


def plausible(n: int, file_size: int) -> bool:
    """A header of ``n`` bytes fits the library's limit and a file of ``file_size`` bytes."""
    return n <= MAX_HEADER_BYTES and 8 + n <= file_size


def decode(raw: bytes, loads: Callable[[bytes], Any] = json.loads
           ) -> tuple[dict[str, Any], Any]:
    """(tensor name -> its entry as written, ``__metadata__`` or {}) of the JSON header ``raw``.

    Raises:
        ValueError: not JSON, or not a JSON object.
    """
    body = loads(raw)
    if not isinstance(body, dict):
        raise ValueError("header is not an object")
    meta = body.pop("__metadata__", None) or {}
    return body, meta


def encode(tensors: dict[str, tuple[str, tuple[int, ...]]],
           metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A safetensors file's leading bytes for ``{name: (dtype tag, shape)}``, and each tensor's
    byte range after them, laid out as the library lays them out (its order; the JSON padded
    with spaces to 8 bytes), so a file written piece by piece from this header holds what
    ``safetensors.save_file`` would have written: the same header (the library orders the
    metadata as its hash map does, so only up to that order) and the same data bytes."""
    order = sorted(tensors, key=lambda k: (_LAYOUT_RANK[tensors[k][0]], k))
    body: dict[str, object] = {"__metadata__": dict(metadata)}
    ranges, pos = {}, 0
    for k in order:
        tag, shape = tensors[k]
        n = TAG_BYTES[tag] * math.prod(shape)
        ranges[k] = (pos, pos + n)
        body[k] = {"dtype": tag, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(body, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, ranges
