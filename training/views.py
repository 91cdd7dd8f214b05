"""Each trainer's view of one sample: its key names, shapes and dtypes, as torch tensors.

Views: ``hsfarm`` (ours), ``specforge``, ``modelopt`` and ``speculators`` (each as its own
loader reads it; keys and shapes: docs/output.md). The tensors share memory with the arrays
given (the loader's memory maps): no copy, except speculators' stacked ``[T, 4, H]``, which
has to interleave, and its derived pre-norm slot.
Test: tests/farm/test_training.py::test_loader_views_hold_our_tensors_without_a_copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from training.prenorm import speculators_stack

VIEWS = ("hsfarm", "specforge", "modelopt", "speculators")


def tensor(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch tensor over ``arr``'s memory (bf16 held as uint16 becomes bfloat16)."""
    if dtype == "BF16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def hsfarm(key: str, a: Mapping[str, np.ndarray], norm_w: np.ndarray | None) -> dict[str, Any]:
    return {T_INPUT_IDS: tensor(a[T_INPUT_IDS], "I64"),
            T_LOSS_MASK: tensor(a[T_LOSS_MASK], "I64"),
            T_HIDDEN: tensor(a[T_HIDDEN], "BF16"), T_AUX: tensor(a[T_AUX], "BF16")}


def specforge(key: str, a: Mapping[str, np.ndarray], norm_w: np.ndarray | None) -> dict[str, Any]:
    """Hidden tensors with a leading 1 as SpecForge's writer saves them; ids and mask [T]."""
    ours = hsfarm(key, a, norm_w)
    return {**ours, T_HIDDEN: ours[T_HIDDEN][None], T_AUX: ours[T_AUX][None]}


def modelopt(key: str, a: Mapping[str, np.ndarray], norm_w: np.ndarray | None) -> dict[str, Any]:
    """Model-Optimizer's plural key names; post-norm, as its default expects."""
    ours = hsfarm(key, a, norm_w)
    return {"input_ids": ours[T_INPUT_IDS], "hidden_states": ours[T_HIDDEN],
            "aux_hidden_states": ours[T_AUX], "loss_mask": ours[T_LOSS_MASK],
            "conversation_id": key, "hidden_states_prenorm": False}


def speculators(key: str, a: Mapping[str, np.ndarray],
                norm_w: np.ndarray | None) -> dict[str, Any]:
    if norm_w is None:
        raise ValueError("the speculators view needs the final-norm weight")
    return {"token_ids": tensor(a[T_INPUT_IDS], "I64"),
            "hidden_states": tensor(speculators_stack(a, norm_w), "BF16"),
            "loss_mask": tensor(a[T_LOSS_MASK], "I64")}


VIEW_FUNCS: dict[str, Callable[[str, Mapping[str, np.ndarray], np.ndarray | None],
                               dict[str, Any]]] = {
    "hsfarm": hsfarm, "specforge": specforge, "modelopt": modelopt, "speculators": speculators}
