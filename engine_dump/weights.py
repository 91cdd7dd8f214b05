"""The identity of the checkpoint a server loaded, as each hook publishes it (marker, dumps).

Computed from the local model dir, or from the Hugging Face cache snapshot of a hub id
(present once the engine has loaded it), by ``contracts.weights_identity``. It never raises:
a serving process never dies for its identity, which then has no shards and says why.
Test: tests/unit/test_weights.py::test_a_hook_publishes_what_it_loaded_and_never_raises
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from engine_dump import contracts as c

log = logging.getLogger("hsfarm.hook")


def model_config_sha256(model_path: str) -> str:
    """sha256 of the model dir's ``config.json``; empty when there is none (a hub id)."""
    try:
        return hashlib.sha256((Path(model_path) / "config.json").read_bytes()).hexdigest()
    except OSError:
        return ""


def loaded_weights(model_path: str, revision: str | None = None,
                   download_dir: str | None = None) -> dict[str, Any]:
    """The weights identity of ``model_path`` (a dir, or a hub id already in the cache); on any
    failure the identity of no shards with ``error`` saying why (the canary still guards)."""
    path = model_path
    try:
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, revision=revision, cache_dir=download_dir,
                                     local_files_only=True)
        identity = c.weights_identity(Path(path))
    except Exception as e:  # a serving process never dies for its identity
        log.warning("hsfarm: the weights identity of %s cannot be computed: %s", path, e)
        empty = c.weights_identity(Path("/nonexistent"))
        return {**empty, "error": f"{type(e).__name__}: {e}"}
    log.info("hsfarm: weights identity %s (%d shards in %s)", identity["id"],
             len(identity["shards"]), path)
    return identity
