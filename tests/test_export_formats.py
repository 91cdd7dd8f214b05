"""speculators' read-back check of its aux slots, hashed in place (training/export/formats.py)."""

from __future__ import annotations

import numpy as np

from sglang_patch import contracts as c
from training import checksums
from training.export.formats import Speculators
from worker import checksums as ck


def test_the_aux_slots_hash_in_place_as_the_sources_aux_tensor() -> None:
    # Given a [T, 4, H] stack whose first three slots are a source's [T, 3H] aux tensor
    rng = np.random.default_rng(0)
    aux = rng.integers(0, 0xFFFF, (5, 3 * 8), dtype=np.uint16)
    stack = np.empty((5, 4, 8), np.uint16)
    stack[:, :3] = aux.reshape(5, 3, 8)
    stack[:, 3] = 7
    # Then hashed row by row in place it has the source's checksum (both algorithms),
    # and a non-contiguous stack the same
    for algorithm in (ck.XXH3_128, ck.SHA256):
        want = checksums.of(aux, algorithm)
        assert Speculators.aux_checksum(stack, algorithm) == want
        assert Speculators.aux_checksum(np.asfortranarray(stack), algorithm) == want
    # And one flipped aux value (not the pre-norm slot) changes it
    recorded = checksums.Recorded(ck.XXH3_128, {c.T_AUX: checksums.of(aux)})
    stack[2, 3, 0] ^= 1
    assert Speculators.aux_checksum(stack, ck.XXH3_128) == recorded.sums[c.T_AUX]
    stack[2, 1, 0] ^= 1
    assert Speculators.aux_checksum(stack, ck.XXH3_128) != recorded.sums[c.T_AUX]
