"""The three containers: where each sample goes, how it is written and read back.

``specforge``: ``samples/<shard>/<key>.ckpt``; ``modelopt``: ``samples/<shard>/<key>.pt``;
``speculators``: ``hidden_states/hs_{i}.safetensors``, ``i`` given at commit so the numbers
stay contiguous (keys and shapes: docs/output.md). torch is imported only where a container
needs it, so the producer CLI runs without torch. Each copied tensor read back is checked
against the source's checksum, which catches a damaged source in the same pass; speculators'
[T, 4, H] stack is derived and checked a few tokens at a time (tests/unit/test_export_formats.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from engine_dump.dumpfile import AUX_LAYERS, T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from training.prenorm import speculators_chunks
from training.sample_file import NP_DTYPES, SampleFile
from worker.core import checksums, diskio, durable, outdir, tensorfile
from worker.core.errors import Corrupt

Arrays = Mapping[str, np.ndarray]
Names = Mapping[str, str]  # output tensor -> source tensor with the same bytes


class Format:
    """One trainer's container. ``write`` returns the checksums the output must read back to."""

    name = ""
    needs_norm = False
    numbered = False  # speculators: file names are row numbers given at commit
    source_of: ClassVar[Names] = {}
    derived: ClassVar[tuple[str, ...]] = ()  # output tensors computed, not copied

    def rel_path(self, key: str, number: int = 0) -> str:
        raise NotImplementedError

    def write(self, tmp: Path, key: str, src: Arrays, src_sums: checksums.Recorded,
              norm_w: np.ndarray | None) -> dict[str, str]:
        """Write ``tmp``; return the checksums of the derived output tensors (those that are
        not copies of a source tensor), as written.

        Raises:
            Corrupt: a source tensor that an output is derived from fails its checksum.
        """
        raise NotImplementedError

    def read_back(self, path: Path) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def check(self, path: Path, src_sums: checksums.Recorded,
              derived_sums: Mapping[str, str] | None) -> list[str]:
        """Read ``path`` (its pages already dropped) and return its ``problems``.

        Raises:
            Corrupt, OSError, ValueError, KeyError, RuntimeError: not a readable file.
        """
        return self.problems(self.read_back(path), src_sums, derived_sums)

    def problems(self, back: Mapping[str, np.ndarray], src_sums: checksums.Recorded,
                 derived_sums: Mapping[str, str] | None) -> list[str]:
        """What read back differs from the source's checksums or from the derived tensors'
        (``derived_sums``: their checksums as written; None where a ledger did not record
        them, and only the copies are checked)."""
        want = dict(derived_sums or {})
        out = [f"{o} is missing" for o in [*self.source_of, *self.derived, *want]
               if o not in back]
        if out:
            return out
        out += [f"{o} differs from source {s}" for o, s in self.source_of.items()
                if not src_sums.matches(s, back[o])]
        return out + [f"{o} reads back differently" for o, s in want.items()
                      if checksums.of(back[o]) != s]


def _torch_raw(t: Any) -> np.ndarray:
    """A loaded torch tensor's bytes as numpy (bf16 as uint16), for checksums."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()


def _read_ahead(path: Path) -> None:
    diskio.advise(path, os.POSIX_FADV_WILLNEED)


_crc_lock = threading.Lock()
_crc_off_count = 0
_crc_was: bool = True


@contextlib.contextmanager
def _no_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the zip records' CRC32 while any export thread is saving.

    The CRC cost ~0.3 s per 470 MB sample here (1.6 GB/s, most of the CPU a save spends),
    and checks nothing we rely on: every output tensor is read back from the disk and compared
    with the source's xxh3 checksums, and ``torch.load`` loads such a file (documented with
    ``torch.serialization.set_crc32_options``; only unzip tools would complain). Counted, so
    overlapping saves in several threads restore torch's setting when the last one ends.
    """
    from torch import serialization

    global _crc_off_count, _crc_was
    with _crc_lock:
        if _crc_off_count == 0:
            _crc_was = serialization.get_crc32_options()
            serialization.set_crc32_options(False)
        _crc_off_count += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_off_count -= 1
            if _crc_off_count == 0:
                serialization.set_crc32_options(_crc_was)


class _TorchSave(Format):
    suffix = ""

    def rel_path(self, key: str, number: int = 0) -> str:
        return f"samples/{outdir.shard_of(key)}/{key}{self.suffix}"

    def view(self, key: str, src: Arrays) -> dict[str, Any]:
        raise NotImplementedError

    def write(self, tmp: Path, key: str, src: Arrays, src_sums: checksums.Recorded,
              norm_w: np.ndarray | None) -> dict[str, str]:
        import torch

        with durable.WritebackFile(tmp) as f, _no_zip_crc32():
            torch.save(self.view(key, src), f)
        return {}  # every tensor is a copy of a source tensor

    def read_back(self, path: Path) -> dict[str, np.ndarray]:
        """The file's tensors, mapped; the whole file asked for at once (read ahead in file
        order while the first tensors are hashed, not faulted in page by page)."""
        import torch

        _read_ahead(path)
        obj = torch.load(path, weights_only=True, mmap=True)
        return {k: _torch_raw(v) for k, v in obj.items() if isinstance(v, torch.Tensor)}


class SpecForge(_TorchSave):
    name, suffix = "specforge", ".ckpt"
    source_of: ClassVar[Names] = {k: k for k in (T_INPUT_IDS, T_LOSS_MASK, T_HIDDEN,
                                                 T_AUX)}

    def view(self, key: str, src: Arrays) -> dict[str, Any]:
        from training import views

        return views.specforge(key, src, None)


class ModelOpt(_TorchSave):
    name, suffix = "modelopt", ".pt"
    source_of: ClassVar[Names] = {"input_ids": T_INPUT_IDS, "loss_mask": T_LOSS_MASK,
                                  "hidden_states": T_HIDDEN, "aux_hidden_states": T_AUX}

    def view(self, key: str, src: Arrays) -> dict[str, Any]:
        from training import views

        return views.modelopt(key, src, None)


class Speculators(Format):
    name, needs_norm, numbered = "speculators", True, True
    source_of: ClassVar[Names] = {"token_ids": T_INPUT_IDS, T_LOSS_MASK: T_LOSS_MASK}

    derived: ClassVar[tuple[str, ...]] = ("hidden_states",)

    def problems(self, back: Mapping[str, np.ndarray], src_sums: checksums.Recorded,
                 derived_sums: Mapping[str, str] | None) -> list[str]:
        problems = super().problems(back, src_sums, derived_sums)
        if not problems and src_sums.sums.get(T_AUX) != self.aux_checksum(
                back["hidden_states"], src_sums.algorithm):
            problems.append(f"hidden_states[:, :3] differs from source {T_AUX}")
        return problems

    def rel_path(self, key: str, number: int = 0) -> str:
        return f"hidden_states/hs_{number}.safetensors"

    def write(self, tmp: Path, key: str, src: Arrays, src_sums: checksums.Recorded,
              norm_w: np.ndarray | None) -> dict[str, str]:
        assert norm_w is not None
        if checksums.mismatches(src_sums, {T_HIDDEN: src[T_HIDDEN]}):
            raise Corrupt(f"source checksum of {T_HIDDEN}")
        t, h = src[T_HIDDEN].shape
        copies = {"token_ids": src[T_INPUT_IDS], T_LOSS_MASK: src[T_LOSS_MASK]}
        head, header = tensorfile.encode_header(
            {"token_ids": ("I64", (t,)), T_LOSS_MASK: ("I64", (t,)),
             "hidden_states": ("BF16", (t, AUX_LAYERS + 1, h))}, {"sample_key": key})
        stacked = checksums.new_hasher()
        with durable.WritebackFile(tmp) as f:
            f.write(head)
            for name, _, _ in header.file_ranges():
                if name != "hidden_states":
                    f.write(np.ascontiguousarray(copies[name], np.int64).data)
                    continue
                for chunk in speculators_chunks(src, norm_w):
                    f.write(chunk.data)
                    stacked.update(chunk.data)
        return {"hidden_states": stacked.hexdigest()}

    def check(self, path: Path, src_sums: checksums.Recorded,
              derived_sums: Mapping[str, str] | None) -> list[str]:
        """One sequential pass over the file from the disk, in chunks: the copies kept (a few
        KB), the stack hashed whole and its aux slots row by row as it streams past."""
        with diskio.DiskReader(path) as reader:  # its pages dropped: then asked for whole
            os.posix_fadvise(reader.fd, 0, 0, os.POSIX_FADV_WILLNEED)
            header = tensorfile.read_header_fd(reader.fd, path.name)
            names = [*self.source_of, *self.derived, *(derived_sums or {})]
            missing = [f"{o} is missing" for o in names if o not in header.tensors]
            if missing:
                return missing
            feed = _StackFeed(header, src_sums.algorithm)
            for offset, view in reader.chunks():
                feed.add(offset, view)
        if feed.seen != header.size_bytes:
            raise Corrupt(f"{path.name}: read {feed.seen} of {header.size_bytes} bytes")
        out = [f"{o} differs from source {s}" for o, s in self.source_of.items()
               if not src_sums.matches(s, feed.small(o))]
        want = dict(derived_sums or {})
        if "hidden_states" in want and feed.stacked.hexdigest() != want["hidden_states"]:
            out.append("hidden_states reads back differently")
        if not out and src_sums.sums.get(T_AUX) != feed.aux.hexdigest():
            out.append(f"hidden_states[:, :3] differs from source {T_AUX}")
        return out

    def read_back(self, path: Path) -> dict[str, np.ndarray]:
        tf = tensorfile.read(path)
        return {k: t.array for k, t in tf.tensors.items()}

    @staticmethod
    def aux_checksum(hidden_states: np.ndarray, algorithm: str) -> str:
        """The checksum of ``aux_part``, hashed row by row where the rows lie (each token's
        three aux slots are contiguous in a C-ordered stack): no copy of the [T,3H] part."""
        if not hidden_states.flags.c_contiguous:
            return checksums.of(Speculators.aux_part(hidden_states), algorithm)
        h = checksums.new_hasher(algorithm)
        for row in hidden_states:
            h.update(row[: AUX_LAYERS].data)
        return h.hexdigest()

    @staticmethod
    def aux_part(hidden_states: np.ndarray) -> np.ndarray:
        """The three aux slots of a [T,4,H] stack as our [T,3H] (for the source checksum)."""
        t = hidden_states.shape[0]
        return np.ascontiguousarray(hidden_states[:, : AUX_LAYERS]).reshape(t, -1)

    @staticmethod
    def ids_and_mask(path: Path) -> tuple[np.ndarray, np.ndarray]:
        sf = SampleFile.open(path)
        return sf.read("token_ids"), sf.read(T_LOSS_MASK)


class _StackFeed:
    """Routes a speculators file's bytes, chunk by chunk: ``hidden_states`` to a hasher of
    the whole stack and (its first three slots of each token) to one of the aux part; the
    small tensors kept."""

    def __init__(self, header: tensorfile.Header, algorithm: str) -> None:
        self.ranges = header.file_ranges()
        stack = header.tensors["hidden_states"]
        self.row_bytes = stack.nbytes // max(1, stack.shape[0])
        self.aux_bytes = self.row_bytes * AUX_LAYERS // (AUX_LAYERS + 1)
        self.stacked = checksums.new_hasher()
        self.aux = checksums.new_hasher(algorithm)
        self.kept: dict[str, bytearray] = {}
        self.dtypes = {n: e.dtype for n, e in header.tensors.items()}
        self.seen = 0

    def add(self, offset: int, view: memoryview) -> None:
        end = offset + len(view)
        for name, begin, nbytes in self.ranges:
            lo, hi = max(begin, offset), min(begin + nbytes, end)
            if lo >= hi:
                continue
            piece = view[lo - offset : hi - offset]
            if name == "hidden_states":
                self.stacked.update(piece)
                self._aux(piece, lo - begin)
            else:
                self.kept.setdefault(name, bytearray()).extend(piece)
        self.seen = max(self.seen, end)

    def _aux(self, piece: memoryview, at: int) -> None:
        """Feed the aux hasher the aux bytes of ``piece`` (stack bytes from ``at``)."""
        end = at + len(piece)
        for row in range(at // self.row_bytes, (end - 1) // self.row_bytes + 1):
            lo = max(at, row * self.row_bytes)
            hi = min(end, row * self.row_bytes + self.aux_bytes)
            if lo < hi:
                self.aux.update(piece[lo - at : hi - at])

    def small(self, name: str) -> np.ndarray:
        return np.frombuffer(self.kept.get(name, bytearray()), NP_DTYPES[self.dtypes[name]])


FORMATS: dict[str, Format] = {f.name: f for f in (SpecForge(), ModelOpt(), Speculators())}
