"""Checksums of final files: the one module that writes and reads them, old format included."""

from __future__ import annotations

import hashlib
import json

import pytest

from worker.core import checksums as ck
from worker.core.errors import Corrupt


def test_xxh3_128_is_the_default_and_streams() -> None:
    assert ck.DEFAULT_ALGORITHM == ck.XXH3_128
    assert ck.tensor_checksum(b"") == "99aa06d3014798d86001c324468d497f"  # reference value
    h = ck.new_hasher()
    for piece in (b"a", b"b", b"c"):
        h.update(memoryview(piece))
    assert h.hexdigest() == ck.tensor_checksum(b"abc")
    assert len(ck.tensor_checksum(b"x" * 1000)) == ck.DIGEST_HEX_LEN  # headers sized before


def test_new_metadata_records_the_algorithm() -> None:
    meta = ck.checksum_metadata({"b": "2", "a": "1"})
    assert meta[ck.M_ALGORITHM] == "xxh3-128"
    assert ck.file_checksums(meta) == ("xxh3-128", {"a": "1", "b": "2"})


def test_files_written_before_the_algorithm_was_recorded_read_as_sha256() -> None:
    # Given the metadata the worker wrote before issue 9
    sums = {"input_ids": hashlib.sha256(b"x").hexdigest()}
    old = {"sha256": json.dumps(sums), "sample_key": "k"}
    # Then they are sha256 checksums, and sha256 recomputes them
    algorithm, got = ck.file_checksums(old)
    assert (algorithm, got) == ("sha256", sums)
    assert ck.tensor_checksum(b"x", algorithm) == sums["input_ids"]


@pytest.mark.parametrize("meta, why", [
    ({}, "no checksums"),
    ({"checksum_algorithm": "xxh3-128"}, "no checksums"),
    ({"checksum_algorithm": "crc32", "checksums": "{}"}, "unknown checksum algorithm"),
    ({"sha256": "not json"}, "not JSON"),
    ({"sha256": "[1, 2]"}, "not a"),
])
def test_unusable_checksum_metadata_is_corrupt(meta: dict[str, str], why: str) -> None:
    with pytest.raises(Corrupt, match=why):
        ck.file_checksums(meta)
