"""Source dirs for ``adopt`` tests, written by the reference model as other tools write them:
SpecForge's ``data_<i>.ckpt``, plain torch ``.pt`` dicts, another hsfarm output dir; and
damaged or hostile files beside them."""

from __future__ import annotations

import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from sglang_patch.reference_model import ReferenceModel
from worker.core import checksums, tensorfile
from worker.core.samples import validate_record
from worker.server.chat import ChatTokenizer


class Extracted:
    """One record's ids, this run's mask, and the model's bf16 states (torch tensors)."""

    def __init__(self, ids: list[int], mask: list[int], hidden: torch.Tensor,
                 aux: torch.Tensor) -> None:
        self.ids, self.mask, self.hidden, self.aux = ids, mask, hidden, aux


def extract(model_dir: Path, records: list[dict[str, Any]], chat: ChatTokenizer,
            layers: tuple[int, ...] | None = None) -> list[Extracted]:
    """Each record tokenized as the run does, run through the model in one pass."""
    model = ReferenceModel(model_dir, layers_to_capture=layers, threads=1)
    out = []
    for rec in records:
        tok = chat.encode(validate_record(rec))
        o = model.forward_chunk(model.new_cache(), tok.input_ids, 0)
        out.append(Extracted(tok.input_ids, tok.loss_mask, o.hidden.to(torch.bfloat16),
                             o.aux.to(torch.bfloat16)))
    return out


def write_specforge(src: Path, items: list[Extracted], seed: int = 0) -> list[Path]:
    """``data_<i>.ckpt`` as SpecForge's offline generator saves them, in shuffled order."""
    src.mkdir(parents=True, exist_ok=True)
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    paths = []
    for i, j in enumerate(order):
        e = items[j]
        p = src / f"data_{i}.ckpt"
        torch.save({"input_ids": torch.tensor(e.ids), "loss_mask": torch.tensor(e.mask),
                    "hidden_state": e.hidden[None], "aux_hidden_state": e.aux[None]}, p)
        paths.append(p)
    return paths


def write_torch(src: Path, items: list[Extracted]) -> None:
    """``aux_<i>.pt`` as a hand-written dump script leaves them: three aux keys, other names."""
    src.mkdir(parents=True, exist_ok=True)
    for i, e in enumerate(items):
        h = e.hidden.shape[1]
        torch.save({"ids": torch.tensor(e.ids), "final": e.hidden,
                    **{f"aux{k}": e.aux[:, k * h:(k + 1) * h].clone() for k in range(3)}},
                   src / f"aux_{i}.pt")


def write_hsfarm(src: Path, items: list[Extracted]) -> None:
    """Another host's hsfarm output dir: a manifest and checksummed safetensors files."""
    (src / "samples" / "00").mkdir(parents=True, exist_ok=True)
    (src / "manifest.json").write_text(json.dumps({"fingerprint_id": "another-host"}))
    for i, e in enumerate(items):
        tensors = {T_INPUT_IDS: tensorfile.Tensor("I64", np.asarray(e.ids, dtype=np.int64)),
                   T_LOSS_MASK: tensorfile.Tensor("I64", np.asarray(e.mask, dtype=np.int64)),
                   T_HIDDEN: tensorfile.Tensor("BF16", bits(e.hidden)),
                   T_AUX: tensorfile.Tensor("BF16", bits(e.aux))}
        sums = {k: checksums.tensor_checksum(np.ascontiguousarray(t.array).data)
                for k, t in tensors.items()}
        tensorfile.write(src / "samples" / "00" / f"s{i}.safetensors", tensors,
                         checksums.checksum_metadata(sums))


def write_hsfarm_damaged(src: Path, flipped: Extracted, truncated: Extracted) -> None:
    """Beside ``write_hsfarm``'s files: one with a bit of its hidden state flipped (its
    checksum no longer matches), one cut short."""
    tmp = src / "tmp"
    write_hsfarm(tmp, [flipped, truncated])
    raw = bytearray((tmp / "samples" / "00" / "s0.safetensors").read_bytes())
    raw[-100] ^= 0x01  # inside the last tensor's data (hidden_state / aux: both bf16)
    (src / "samples" / "00" / "flipped.safetensors").write_bytes(bytes(raw))
    whole = (tmp / "samples" / "00" / "s1.safetensors").read_bytes()
    (src / "samples" / "00" / "cut.safetensors").write_bytes(whole[: len(whole) - 4096])
    shutil.rmtree(tmp)


def bits(t: torch.Tensor) -> np.ndarray:
    """A bf16 tensor's bit patterns (uint16)."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


class _RunsCode:
    """Unpickling this would run a shell command (the attack ``weights_only`` stops)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))


def write_bad(src: Path, good: Extracted, marker: Path) -> dict[str, str]:
    """Damaged and hostile files beside good ones; file name -> what the refusal must say."""
    torch.save({"input_ids": torch.tensor(good.ids), "hidden_state": _RunsCode(marker)},
               src / "data_900.ckpt")
    with open(src / "data_901.ckpt", "wb") as f:
        pickle.dump({"input_ids": _RunsCode(marker)}, f)
    whole = (src / "data_0.ckpt").read_bytes()
    (src / "data_902.ckpt").write_bytes(whole[: len(whole) // 2])
    nan = good.hidden.clone()
    nan[1, 3] = float("nan")
    torch.save({"input_ids": torch.tensor(good.ids), "hidden_state": nan[None],
                "aux_hidden_state": good.aux[None]}, src / "data_903.ckpt")
    torch.save({"input_ids": torch.tensor(good.ids), "hidden_state": good.hidden[None, :, :32],
                "aux_hidden_state": good.aux[None]}, src / "data_904.ckpt")
    torch.save({"input_ids": torch.tensor([1, 2, 3, 4]), "hidden_state": good.hidden[None, :4],
                "aux_hidden_state": good.aux[None, :4]}, src / "data_905.ckpt")
    return {"data_900.ckpt": "GLOBAL posix.system", "data_901.ckpt": "weights_only",
            "data_902.ckpt": "unreadable", "data_903.ckpt": "NaN/Inf",
            "data_904.ckpt": "hidden size 32", "data_905.ckpt": "match no record"}


def tail_of(good: Extracted, other: Extracted, row: int) -> Extracted:
    """``good``'s states up to ``row``, ``other``'s (the same ids, another checkpoint) from it."""
    hidden, aux = good.hidden.clone(), good.aux.clone()
    hidden[row:], aux[row:] = other.hidden[row:], other.aux[row:]
    return Extracted(good.ids, good.mask, hidden, aux)


def shifted_from(good: Extracted, row: int) -> Extracted:
    """``good``'s states with every row from ``row`` on holding the state of the row before."""
    hidden, aux = good.hidden.clone(), good.aux.clone()
    hidden[row + 1:], aux[row + 1:] = good.hidden[row:-1], good.aux[row:-1]
    return Extracted(good.ids, good.mask, hidden, aux)
