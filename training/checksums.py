"""Checksums, read and computed through the worker's one implementation (``worker.core.checksums``).

Every checksum the training side checks or writes goes through here, so when the farm
changes its algorithm this is the one place that follows. A file records its algorithm (old
files: sha256); checks use the algorithm of the file the checksums came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from worker.core import checksums as ck
from worker.core.errors import Corrupt


def of(arr: np.ndarray, algorithm: str = ck.DEFAULT_ALGORITHM) -> str:
    """The checksum of one tensor's raw bytes, as the worker computes it."""
    return ck.tensor_checksum(np.ascontiguousarray(arr).data, algorithm)


def hasher(algorithm: str = ck.DEFAULT_ALGORITHM) -> ck.Hasher:
    """A streaming hasher: fed a tensor's bytes in order, its digest equals ``of``'s."""
    return ck.new_hasher(algorithm)


@dataclass(frozen=True)
class Recorded:
    """The per-tensor checksums a file (or a manifest entry) records, with their algorithm."""

    algorithm: str = ck.DEFAULT_ALGORITHM
    sums: dict[str, str] = field(default_factory=dict)

    def matches(self, name: str, arr: np.ndarray) -> bool:
        return self.sums.get(name) == of(arr, self.algorithm)

    def to_json(self) -> dict[str, object]:
        return {ck.M_ALGORITHM: self.algorithm, ck.M_CHECKSUMS: dict(self.sums)}

    @classmethod
    def from_json(cls, entry: Mapping[str, object]) -> Recorded:
        sums = entry.get(ck.M_CHECKSUMS)
        return cls(str(entry.get(ck.M_ALGORITHM, ck.DEFAULT_ALGORITHM)),
                   {str(k): str(v) for k, v in sums.items()} if isinstance(sums, dict) else {})


def recorded(metadata: Mapping[str, str]) -> Recorded:
    """The checksums in a file's metadata (none: an empty record, which matches nothing)."""
    try:
        algorithm, sums = ck.file_checksums(metadata)
    except Corrupt:
        return Recorded()
    return Recorded(algorithm, dict(sums))


def as_metadata(sums: Mapping[str, str]) -> dict[str, str]:
    """Per-tensor checksums (of the default algorithm) as metadata entries."""
    return ck.checksum_metadata(sums)


def compute(arrays: Mapping[str, np.ndarray]) -> Recorded:
    return Recorded(ck.DEFAULT_ALGORITHM, {name: of(a) for name, a in arrays.items()})


def mismatches(expected: Recorded, arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the tensors whose checksum is missing from ``expected`` or differs."""
    return [name for name, arr in arrays.items() if not expected.matches(name, arr)]
