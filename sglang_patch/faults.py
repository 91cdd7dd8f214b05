"""Fault injection for the reference server: dumps that are wrong in one specific way.

``--inject-fault KIND:KEY_PREFIX[:ATTEMPTS]`` corrupts the dumps of sample keys starting with
KEY_PREFIX, on attempts up to ATTEMPTS (all when omitted), as ``KINDS`` says, before the
atomic rename. ``shift``, ``other`` and ``prenorm`` (bf16) pass every check but the proof.
Test: tests/farm/test_faults.py::test_corrupt_dumps_are_retried_then_recorded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine_dump import dumpdir
from engine_dump.dump_writer import DumpWriter
from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_HIDDEN_SCALE, T_INPUT_IDS
from engine_dump.rids import parse_rid

# nan: one value (the e4m3 NaN byte in fp8); scale: one final-layer fp8 scale 0; ids: the first
# id off by one; shape: aux loses a column; truncate: cut in half; shift: row i holds row
# i+1's; other: the previous dump's rows; prenorm: the last layer's state before the final norm
KINDS = ("nan", "scale", "ids", "shape", "truncate", "shift", "other", "prenorm")
PROOF_KINDS = ("shift", "other", "prenorm")  # bf16 dumps only


@dataclass(frozen=True)
class Fault:
    kind: str
    key_prefix: str
    max_attempt: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Fault:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[0] not in KINDS:
            raise ValueError(f"--inject-fault {spec!r}: expected KIND:KEY_PREFIX[:ATTEMPTS] with "
                             f"KIND in {', '.join(KINDS)}")
        return cls(parts[0], parts[1], int(parts[2]) if len(parts) == 3 else None)

    def applies(self, rid: str) -> bool:
        r = parse_rid(rid)
        return (r is not None and r.sample_key.startswith(self.key_prefix)
                and (self.max_attempt is None or r.attempt <= self.max_attempt))


class FaultyWriter(DumpWriter):
    """A DumpWriter that corrupts matching dumps before they are renamed into place."""

    def __init__(self, *args: object, faults: list[Fault],
                 final_norm: torch.Tensor | None = None, **kwargs: object) -> None:
        """``final_norm``: the model's final-norm weight (for ``prenorm``)."""
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.faults = faults
        self.final_norm = final_norm
        self._last_hidden: torch.Tensor | None = None  # the last dump's, for ``other``

    def _sealing(self, rid: str, path: Path, metadata: dict[str, str]) -> None:
        fault = next((f for f in self.faults if f.applies(rid)), None)
        if fault is None:
            if any(f.kind == "other" for f in self.faults):
                self._last_hidden = load_file(str(path))[T_HIDDEN]
            return
        t = load_file(str(path))  # test-sized dumps: rewritten whole
        if fault.kind in PROOF_KINDS:
            t[T_HIDDEN] = self._wrong_final(fault.kind, t)
        if fault.kind == "nan":
            if t[T_HIDDEN].element_size() == 1:  # float8 e4m3fn: 0x7F is NaN
                t[T_HIDDEN].view(torch.uint8)[0, 0] = 0x7F
            else:
                t[T_HIDDEN][0, 0] = float("nan")
        elif fault.kind == "scale" and T_HIDDEN_SCALE in t:
            t[T_HIDDEN_SCALE][0, 0] = 0.0
        elif fault.kind == "ids":
            t[T_INPUT_IDS][0] += 1
        elif fault.kind == "shape":
            t[T_AUX] = t[T_AUX][:, :-1].contiguous()
        save_file(t, str(path), metadata=metadata)
        dumpdir.seal(path)  # the dump dir's file mode again, whatever the umask
        if fault.kind == "truncate":
            os.truncate(path, path.stat().st_size // 2)

    def _wrong_final(self, kind: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """A final state of the right shape and dtype, of the wrong rows or layer."""
        h = t[T_HIDDEN]
        if kind == "shift":  # an off-by-one: row i holds position i+1's state
            return torch.cat([h[1:], h[-1:]]).contiguous()
        if kind == "other":  # another sample's rows (this one's, reversed, when none yet)
            other = self._last_hidden if self._last_hidden is not None else h.flip(0)
            reps = -(-h.shape[0] // other.shape[0])
            return other.repeat(reps, 1)[: h.shape[0]].contiguous()
        # prenorm: RMSNorm is h = x / rms(x) * w, so x = h / w * rms(x); the last aux layer's
        # rms stands in for the residual stream's at the top of the model
        assert self.final_norm is not None, "prenorm needs the model's final-norm weight"
        last_aux = t[T_AUX].float()[:, -h.shape[1]:]
        rms = last_aux.pow(2).mean(dim=1, keepdim=True).sqrt()
        return (h.float() / self.final_norm * rms).to(h.dtype).contiguous()
