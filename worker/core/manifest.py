"""The run's manifest, ``<out>/manifest.json``: what the run is, written once, read by all.

Its first process writes it (another's first write wins: every other then compares); the
workers, ``status``, ``audit``, ``adopt`` and the trainers' side read it. Every key it holds is
named here; what the run id is made of is ``run.run_id``. Test: tests/unit/test_store.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine_dump.fingerprint import Fingerprint
from worker.core import durable, outdir
from worker.core.errors import ConfigError

M_FINGERPRINT_ID = "fingerprint_id"  # the fingerprint's id, as in every final file
M_FINGERPRINT = "fingerprint"  # the fingerprint itself: what makes two runs' states comparable
M_RUN_NONCE = "run_nonce"  # random, written once: two runs of one fingerprint differ by it
M_VERSIONS = "versions"  # hsfarm's version and the model path of the first writer (for people)
M_CREATED = "created_at"
M_TENSORS = "tensors"  # what each tensor of a final file is (``finalfile.tensor_semantics``)
M_FINAL_NORM = "final_norm"  # the final-norm weight's file beside it, or why there is none
M_WEIGHTS = "weights"  # the checkpoint's weights identity (``weights``); absent: older runs
M_ADOPTIONS = "adoptions"  # each ``adopt`` into this run (producer/adopt)


def path(out_dir: Path) -> Path:
    return Path(out_dir) / outdir.MANIFEST


def read(out_dir: Path) -> dict[str, Any]:
    """The manifest of ``out_dir``.

    Raises:
        FileNotFoundError: there is none (no run began there).
        ConfigError: it cannot be read, or is not a JSON object.
    """
    p = path(out_dir)
    try:
        body = json.loads(p.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: unreadable manifest ({e}); move it away to start anew") from e
    if not isinstance(body, dict):
        raise ConfigError(f"{p}: unreadable manifest (not a JSON object)")
    return body


def fingerprint(manifest: Mapping[str, Any], where: Path | str = outdir.MANIFEST
                ) -> Fingerprint:
    """The fingerprint a manifest records. Raises ConfigError when it is not whole."""
    try:
        return Fingerprint.from_json(manifest[M_FINGERPRINT])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: unreadable manifest ({e}); move it away to start "
                          "anew") from e


def recorded_weights(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """The weights identity the run recorded; None for a run that recorded none."""
    entry = manifest.get(M_WEIGHTS)
    return entry if isinstance(entry, dict) else None


def model_path(manifest: Mapping[str, Any]) -> str:
    """The model path the run's first writer read ("" when it does not say)."""
    versions = manifest.get(M_VERSIONS)
    return str(versions.get("model_path", "")) if isinstance(versions, dict) else ""


def create(out_dir: Path, fp: Fingerprint, nonce: str, versions: dict[str, str],
           tensors: dict[str, object], final_norm: dict[str, object],
           weights: dict[str, object] | None) -> None:
    """Write the manifest of a new run, unless another process wrote one first (then the
    caller reads and compares it)."""
    body: dict[str, Any] = {M_FINGERPRINT_ID: fp.id, M_FINGERPRINT: fp.to_json(),
                            M_RUN_NONCE: nonce, M_VERSIONS: versions, M_CREATED: time.time(),
                            M_TENSORS: tensors, M_FINAL_NORM: final_norm}
    if weights is not None:
        body[M_WEIGHTS] = weights
    durable.write_new_json(path(out_dir), body)


def check(manifest: Mapping[str, Any], fp: Fingerprint, out_dir: Path) -> None:
    """Refuse an output dir whose run has another fingerprint than ``fp``.

    Raises:
        ConfigError: the differences, and the two ways on.
    """
    diff = fp.differences(fingerprint(manifest, path(out_dir)))
    if diff:
        raise ConfigError(
            f"{out_dir} holds hidden states of another run; refusing to mix them. "
            f"Differences (this run != directory): {'; '.join(diff)}. "
            "Use a new FARM_OUTPUT_DIR, or restore the original settings."
        )


def append(out_dir: Path, name: str, entry: dict[str, object]) -> None:
    """Add ``entry`` to the manifest's list ``name`` (``M_ADOPTIONS``); the caller holds the
    run's enqueue lock, so no other process rewrites it meanwhile."""
    body = read(out_dir)
    body.setdefault(name, []).append(entry)
    durable.write_json(path(out_dir), body)
