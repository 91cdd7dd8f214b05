"""The three containers: where each sample goes, how it is written and read back.

torch is imported only where a container needs it (``torch.save``), so the producer CLI that
imports this module runs on a machine without torch.

- ``specforge``: ``samples/<shard>/<key>.ckpt``, ``torch.save`` of ``input_ids`` [T],
  ``loss_mask`` [T], ``hidden_state`` [1,T,H], ``aux_hidden_state`` [1,T,3H] (its writer's
  shapes; its loader squeezes the leading 1 of the hidden tensors only).
- ``modelopt``: ``samples/<shard>/<key>.pt``, ``torch.save`` of its key names, post-norm
  (``hidden_states_prenorm`` False), ``conversation_id`` = our sample key.
- ``speculators``: ``hidden_states/hs_{i}.safetensors`` with ``token_ids`` [T] and
  ``hidden_states`` [T,4,H] (slot 4 = pre-norm final state), plus our ``loss_mask`` for the
  Arrow rows; ``i`` is given at commit, so the numbers stay contiguous whatever fails.

Read back from the disk, every output tensor that copies a source tensor is checked against
the source's recorded checksum (so a damaged source is caught too, with one hash pass in all);
speculators' stacked tensor is compared with the checksum of what was computed in memory
(kept in the ledger, so a later run checks it again), and its aux part against the source's
checksum, after the source ``hidden_state`` it derives from passed its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sglang_patch import contracts as c
from training import checksums
from training.prenorm import speculators_stack
from training.sample_file import SampleFile
from worker import checksums as ck
from worker import tensorfile
from worker.errors import Corrupt

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
              norm_w: np.ndarray | None) -> dict[str, np.ndarray]:
        """Write ``tmp``; return the derived output tensors (not copies of a source tensor).

        Raises:
            Corrupt: a source tensor that an output is derived from fails its checksum.
        """
        raise NotImplementedError

    def read_back(self, path: Path) -> dict[str, np.ndarray]:
        raise NotImplementedError

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


class _TorchSave(Format):
    suffix = ""

    def rel_path(self, key: str, number: int = 0) -> str:
        return f"samples/{c.shard_of(key)}/{key}{self.suffix}"

    def view(self, key: str, src: Arrays) -> dict[str, Any]:
        raise NotImplementedError

    def write(self, tmp: Path, key: str, src: Arrays, src_sums: checksums.Recorded,
              norm_w: np.ndarray | None) -> dict[str, np.ndarray]:
        import torch

        torch.save(self.view(key, src), tmp)
        return {}  # every tensor is a copy of a source tensor

    def read_back(self, path: Path) -> dict[str, np.ndarray]:
        import torch

        obj = torch.load(path, weights_only=True, mmap=True)
        return {k: _torch_raw(v) for k, v in obj.items() if isinstance(v, torch.Tensor)}


class SpecForge(_TorchSave):
    name, suffix = "specforge", ".ckpt"
    source_of: ClassVar[Names] = {k: k for k in (c.T_INPUT_IDS, c.T_LOSS_MASK, c.T_HIDDEN,
                                                 c.T_AUX)}

    def view(self, key: str, src: Arrays) -> dict[str, Any]:
        from training import views

        return views.specforge(key, src, None)


class ModelOpt(_TorchSave):
    name, suffix = "modelopt", ".pt"
    source_of: ClassVar[Names] = {"input_ids": c.T_INPUT_IDS, "loss_mask": c.T_LOSS_MASK,
                                  "hidden_states": c.T_HIDDEN, "aux_hidden_states": c.T_AUX}

    def view(self, key: str, src: Arrays) -> dict[str, Any]:
        from training import views

        return views.modelopt(key, src, None)


class Speculators(Format):
    name, needs_norm, numbered = "speculators", True, True
    source_of: ClassVar[Names] = {"token_ids": c.T_INPUT_IDS, c.T_LOSS_MASK: c.T_LOSS_MASK}

    derived: ClassVar[tuple[str, ...]] = ("hidden_states",)

    def problems(self, back: Mapping[str, np.ndarray], src_sums: checksums.Recorded,
                 derived_sums: Mapping[str, str] | None) -> list[str]:
        problems = super().problems(back, src_sums, derived_sums)
        if not problems and src_sums.sums.get(c.T_AUX) != self.aux_checksum(
                back["hidden_states"], src_sums.algorithm):
            problems.append(f"hidden_states[:, :3] differs from source {c.T_AUX}")
        return problems

    def rel_path(self, key: str, number: int = 0) -> str:
        return f"hidden_states/hs_{number}.safetensors"

    def write(self, tmp: Path, key: str, src: Arrays, src_sums: checksums.Recorded,
              norm_w: np.ndarray | None) -> dict[str, np.ndarray]:
        assert norm_w is not None
        if checksums.mismatches(src_sums, {c.T_HIDDEN: src[c.T_HIDDEN]}):
            raise Corrupt(f"source checksum of {c.T_HIDDEN}")
        stacked = speculators_stack(src, norm_w)
        out = {"token_ids": tensorfile.Tensor("I64", src[c.T_INPUT_IDS]),
               "hidden_states": tensorfile.Tensor("BF16", stacked),
               c.T_LOSS_MASK: tensorfile.Tensor("I64", src[c.T_LOSS_MASK])}
        tensorfile.write(tmp, out, {"sample_key": key})
        return {"hidden_states": stacked}

    def read_back(self, path: Path) -> dict[str, np.ndarray]:
        tf = tensorfile.read(path)
        return {k: t.array for k, t in tf.tensors.items()}

    @staticmethod
    def aux_checksum(hidden_states: np.ndarray, algorithm: str) -> str:
        """The checksum of ``aux_part``, hashed row by row where the rows lie (each token's
        three aux slots are contiguous in a C-ordered stack): no copy of the [T,3H] part."""
        if not hidden_states.flags.c_contiguous:
            return checksums.of(Speculators.aux_part(hidden_states), algorithm)
        h = ck.new_hasher(algorithm)
        for row in hidden_states:
            h.update(row[: c.AUX_LAYERS].data)
        return h.hexdigest()

    @staticmethod
    def aux_part(hidden_states: np.ndarray) -> np.ndarray:
        """The three aux slots of a [T,4,H] stack as our [T,3H] (for the source checksum)."""
        t = hidden_states.shape[0]
        return np.ascontiguousarray(hidden_states[:, : c.AUX_LAYERS]).reshape(t, -1)

    @staticmethod
    def ids_and_mask(path: Path) -> tuple[np.ndarray, np.ndarray]:
        sf = SampleFile.open(path)
        return sf.read("token_ids"), sf.read(c.T_LOSS_MASK)


FORMATS: dict[str, Format] = {f.name: f for f in (SpecForge(), ModelOpt(), Speculators())}
