"""Checksums, read and computed through the worker's one implementation.

Every checksum the training side checks or writes goes through here, and this calls
``worker.store``: if the farm changes its algorithm, this is the one place that follows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from worker import store

METADATA_KEY = store.M_CHECKSUMS


def of(arr: np.ndarray) -> str:
    """The checksum of one tensor's raw bytes, as the worker computes it."""
    return store.checksum(arr)


def recorded(metadata: Mapping[str, str]) -> dict[str, str]:
    """The per-tensor checksums a file's metadata records ({} when none)."""
    try:
        return dict(json.loads(metadata.get(METADATA_KEY, "{}")))
    except (ValueError, TypeError):
        return {}


def as_metadata(sums: Mapping[str, str]) -> dict[str, str]:
    """Per-tensor checksums as a metadata entry, in the worker's format."""
    return {METADATA_KEY: json.dumps(dict(sums), sort_keys=True)}


def mismatches(expected: Mapping[str, str], arrays: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the tensors whose checksum is missing from ``expected`` or differs."""
    return [name for name, arr in arrays.items() if expected.get(name) != of(arr)]
