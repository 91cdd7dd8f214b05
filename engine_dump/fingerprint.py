"""The run fingerprint: what makes two runs' hidden states comparable, and the capture layers.

Written in the manifest and in every final file; any difference refuses mixing. Standard library
only (the hooks name the capture layers by the same convention). Test: tests/unit/test_rids.py.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property


@dataclass(frozen=True)
class Fingerprint:
    """What makes two runs' hidden states comparable. Any difference refuses mixing.

    Versions of hsfarm and SGLang are recorded in the manifest beside it but are not part of
    the identity: a bug-fix release must not orphan a half-done multi-day run. Nor is the
    model's path (hosts mount it in different places) or its weights (hundreds of GB to hash):
    the model is identified by its config and tokenizer.
    """

    config_sha256: str
    tokenizer_sha256: str
    chat_template_sha256: str
    layers_to_capture: tuple[int, ...]
    layer_convention: str
    hidden_size: int
    dtype: str
    max_tokens: int
    overlong: str
    # A run that regenerates its assistant turns first: its generation settings as canonical
    # JSON (worker/core/settings.py, GenSettings); "" for a run that extracts those given.
    generation: str = ""

    @cached_property
    def id(self) -> str:
        """A short stable id, used in task ids and Redis keys (computed once). A run that does
        not regenerate has the id it had before ``generation`` existed."""
        fields = asdict(self)
        if not self.generation:
            del fields["generation"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> dict[str, object]:
        d = asdict(self)
        d["layers_to_capture"] = list(self.layers_to_capture)
        return d

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Fingerprint:
        fields = dict(d)
        fields["layers_to_capture"] = tuple(fields["layers_to_capture"])  # type: ignore[arg-type]
        return cls(**fields)  # type: ignore[arg-type]

    def differences(self, other: Fingerprint) -> list[str]:
        """Human-readable list of fields that differ: ``name: mine != theirs``."""
        a, b = self.to_json(), other.to_json()
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in a if a[k] != b[k]]


LAYER_CONVENTION = "sglang-capture-input-of-layer"


def default_layers_to_capture(num_layers: int) -> tuple[int, ...]:
    """SGLang's default EAGLE-3 capture ids: the inputs of layers 2, L//2 and L-3.

    These are HF ``hidden_states[i]`` indices (the input of layer i = output of layer i-1),
    the same as SpecForge's draft-config ids [1, L//2-1, L-4] plus one.
    """
    return (2, num_layers // 2, num_layers - 3)
