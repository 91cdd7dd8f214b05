"""speculators' stack: derived and written in chunks, read back from the disk in a stream, its
aux slots hashed in place (training/export/formats.py)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from training.export.formats import FORMATS, Speculators, _StackFeed
from training.prenorm import speculators_stack
from worker.core import checksums, tensorfile
from worker.core import checksums as ck
from worker.core.errors import Corrupt


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
    recorded = checksums.Recorded(ck.XXH3_128, {T_AUX: checksums.of(aux)})
    stack[2, 3, 0] ^= 1
    assert Speculators.aux_checksum(stack, ck.XXH3_128) == recorded.sums[T_AUX]
    stack[2, 1, 0] ^= 1
    assert Speculators.aux_checksum(stack, ck.XXH3_128) != recorded.sums[T_AUX]


def _speculators_file(tmp_path: Path, t: int = 150, h: int = 8) -> tuple[
        Path, checksums.Recorded, dict[str, str], dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(1)
    src: dict[str, np.ndarray] = {
        T_INPUT_IDS: rng.integers(0, 1000, t), T_LOSS_MASK: np.ones(t, np.int64),
        T_HIDDEN: rng.integers(0, 0x3F00, (t, h), dtype=np.uint16),
        T_AUX: rng.integers(0, 0x3F00, (t, 3 * h), dtype=np.uint16)}
    norm_w = rng.uniform(0.5, 2.0, h).astype(np.float32)
    sums = checksums.compute(src)
    path = tmp_path / "hs_0.safetensors"
    derived = FORMATS["speculators"].write(path, "k", src, sums, norm_w)
    return path, sums, derived, src, norm_w


def test_speculators_streams_its_stack_out_and_back_as_computed_whole(tmp_path: Path) -> None:
    # Given a sample of 150 tokens (chunks of 64 rows: the last one short) written in chunks
    path, sums, derived, src, norm_w = _speculators_file(tmp_path)
    fmt = FORMATS["speculators"]
    # Then the file holds the stack computed whole, its recorded checksum is that stack's,
    # and the streamed read-back finds no problem
    back = fmt.read_back(path)
    assert np.array_equal(back["hidden_states"], speculators_stack(src, norm_w))
    assert derived == {"hidden_states": checksums.of(back["hidden_states"])}
    assert fmt.check(path, sums, derived) == []
    # And fed in odd-sized pieces (rows split across pieces) the digests are the same
    header = tensorfile.read_header(path)
    raw = memoryview(path.read_bytes())
    feed = _StackFeed(header, sums.algorithm)
    for lo in range(0, len(raw), 1000):
        feed.add(lo, raw[lo : lo + 1000])
    assert feed.stacked.hexdigest() == derived["hidden_states"]
    assert feed.aux.hexdigest() == sums.sums[T_AUX]


@pytest.mark.parametrize(("where", "why"), [
    ("token_ids", "token_ids differs from source input_ids"),
    ("aux", "hidden_states reads back differently"),
    ("prenorm", "hidden_states reads back differently"),
])
def test_speculators_streamed_check_names_each_damaged_part(tmp_path: Path, where: str,
                                                            why: str) -> None:
    # Given a written file and one byte flipped in one part of it
    path, sums, derived, _, _ = _speculators_file(tmp_path)
    header = tensorfile.read_header(path)
    starts = {n: o for n, o, _ in header.file_ranges()}
    row = (3 + 1) * 8 * 2
    at = {"token_ids": starts["token_ids"] + 3,
          "aux": starts["hidden_states"] + 100 * row + 5,
          "prenorm": starts["hidden_states"] + 100 * row + 3 * 8 * 2 + 1}[where]
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    # Then the streamed check names it; without the ledger's derived checksum, a flipped aux
    # byte is still caught against the source's aux checksum (a pre-norm byte cannot be)
    fmt = FORMATS["speculators"]
    assert fmt.check(path, sums, derived) == [why]
    assert fmt.check(path, sums, derived) == fmt.problems(fmt.read_back(path), sums, derived)
    if where == "aux":
        aux_why = f"hidden_states[:, :3] differs from source {T_AUX}"
        assert fmt.check(path, sums, None) == [aux_why]


def test_speculators_check_refuses_a_cut_short_file(tmp_path: Path) -> None:
    path, sums, derived, _, _ = _speculators_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(Corrupt):
        FORMATS["speculators"].check(path, sums, derived)


def test_torch_saves_skip_the_zip_crc_while_any_export_saves_and_load_as_before(
        tmp_path: Path) -> None:
    # Given torch's CRC setting on (its default) and two export threads whose saves overlap,
    # the first to start ending first
    import torch

    from training.export.formats import _no_zip_crc32

    assert torch.serialization.get_crc32_options()
    first, second = _no_zip_crc32(), _no_zip_crc32()
    first.__enter__()
    second.__enter__()
    # When a sample is saved meanwhile, then the setting is off until the last save ends
    src: dict[str, np.ndarray] = {
        T_INPUT_IDS: np.arange(4), T_LOSS_MASK: np.ones(4, np.int64),
           T_HIDDEN: np.arange(8, dtype=np.uint16).reshape(4, 2),
           T_AUX: np.arange(24, dtype=np.uint16).reshape(4, 6)}
    path = tmp_path / "k.ckpt"
    FORMATS["specforge"].write(path, "k", src, checksums.compute(src), None)
    assert not torch.serialization.get_crc32_options()
    with zipfile.ZipFile(path) as z:  # a zip tool sees the missing CRCs
        assert z.testzip() is not None
    first.__exit__(None, None, None)
    assert not torch.serialization.get_crc32_options()
    second.__exit__(None, None, None)
    assert torch.serialization.get_crc32_options()
    # And the file written without CRCs loads with torch.load, mapped or not, and checks
    for mmap in (False, True):
        back = torch.load(path, weights_only=True, mmap=mmap)
        assert back[T_HIDDEN].shape == (1, 4, 2)
    assert FORMATS["specforge"].check(path, checksums.compute(src), {}) == []
