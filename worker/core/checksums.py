"""Per-tensor checksums of final files: the one place that computes them and reads them back.

Two forms verify: ``checksum_algorithm`` = ``xxh3-128`` with ``checksums`` = JSON
``{tensor name: hex digest}`` (written), or ``sha256`` without it (read only). xxh3-128
detects corruption, not tampering, at memory speed (~30 GB/s here, sha256 1.8 GB/s).
Test: tests/unit/test_store.py::test_files_of_the_previous_format_still_verify."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from worker.core.errors import Corrupt

M_ALGORITHM = "checksum_algorithm"
M_CHECKSUMS = "checksums"
M_LEGACY_SHA256 = "sha256"  # the metadata key of files written before the algorithm was recorded

XXH3_128 = "xxh3-128"
SHA256 = "sha256"
DEFAULT_ALGORITHM = XXH3_128
DIGEST_HEX_LEN = 32  # of DEFAULT_ALGORITHM: a header can be sized before its digests are known


class Hasher(Protocol):
    """What ``new_hasher`` returns: feed bytes in pieces, then read the digest."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> Hasher:
    """A streaming hasher for one tensor's bytes.

    Raises:
        Corrupt: the algorithm is not one this version knows (a file from a newer farm?).
    """
    if algorithm == XXH3_128:
        return xxhash.xxh3_128()
    if algorithm == SHA256:
        return hashlib.sha256()
    raise Corrupt(f"unknown checksum algorithm {algorithm!r}")


def tensor_checksum(data: bytes | bytearray | memoryview,
                    algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The checksum of one tensor's raw little-endian bytes (C order), as stored in files."""
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def checksum_metadata(sums: Mapping[str, str],
                      algorithm: str = DEFAULT_ALGORITHM) -> dict[str, str]:
    """The metadata entries that record ``sums`` (tensor name → hex digest) in a file."""
    return {M_ALGORITHM: algorithm, M_CHECKSUMS: json.dumps(dict(sums), sort_keys=True)}


def file_checksums(metadata: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """(algorithm, {tensor name: hex digest}) recorded in a file's metadata, old or new format.

    Raises:
        Corrupt: no checksums, unreadable ones, or an unknown algorithm.
    """
    algorithm = metadata.get(M_ALGORITHM)
    key = M_CHECKSUMS if algorithm is not None else M_LEGACY_SHA256
    algorithm = algorithm or SHA256
    raw = metadata.get(key)
    if raw is None:
        raise Corrupt(f"no checksums in the metadata (key {key!r})")
    try:
        sums = json.loads(raw)
    except ValueError as e:
        raise Corrupt(f"checksums in the metadata are not JSON: {e}") from e
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise Corrupt("checksums in the metadata are not a {name: digest} object")
    new_hasher(algorithm)  # raises Corrupt for an algorithm this version does not know
    return algorithm, sums


def of(arr: np.ndarray, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The checksum of one array's raw bytes (C order), as ``tensor_checksum``."""
    return tensor_checksum(np.ascontiguousarray(arr).data, algorithm)


@dataclass(frozen=True)
class Recorded:
    """The per-tensor checksums a file (or a manifest entry) records, with their algorithm."""

    algorithm: str = DEFAULT_ALGORITHM
    sums: dict[str, str] = field(default_factory=dict)

    def matches(self, name: str, arr: np.ndarray) -> bool:
        return self.sums.get(name) == of(arr, self.algorithm)

    def to_json(self) -> dict[str, object]:
        return {M_ALGORITHM: self.algorithm, M_CHECKSUMS: dict(self.sums)}

    @classmethod
    def from_json(cls, entry: Mapping[str, object]) -> Recorded:
        sums = entry.get(M_CHECKSUMS)
        return cls(str(entry.get(M_ALGORITHM, DEFAULT_ALGORITHM)),
                   {str(k): str(v) for k, v in sums.items()} if isinstance(sums, dict) else {})


def recorded(metadata: Mapping[str, str]) -> Recorded:
    """The checksums in a file's metadata (none: an empty record, which matches nothing)."""
    try:
        algorithm, sums = file_checksums(metadata)
    except Corrupt:
        return Recorded()
    return Recorded(algorithm, dict(sums))


def compute(arrays: Mapping[str, np.ndarray]) -> Recorded:
    return Recorded(DEFAULT_ALGORITHM, {name: of(a) for name, a in arrays.items()})


def mismatches(expected: Recorded, arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the tensors whose checksum is missing from ``expected`` or differs."""
    return [name for name, arr in arrays.items() if not expected.matches(name, arr)]
