"""Is the server the run's? What one probe dump says about the served model, against the run.

A probe dump's metadata (``engine_dump.probe``) names the loaded weights, the captured layers,
the model config and its writer, whose ready marker says the stored dtype; each is compared
with the run's. A worker checks at its start, ``adopt`` before it reads a source file: one
check, so both refuse the same servers with the same words. Test: tests/farm/test_weights.py::
test_a_server_serving_other_weights_than_the_run_is_refused_at_first_and_later_starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine_dump.dumpfile import M_WRITER
from engine_dump.fingerprint import Fingerprint
from engine_dump.probe import served_weights
from worker.core import dumps, weights
from worker.core.errors import ConfigError
from worker.core.settings import Settings


def problems(settings: Settings, fingerprint: Fingerprint, probe_meta: dict[str, str], *,
             recorded: dict[str, Any] | None, local: dict[str, Any] | None,
             model_path: Path, manifest: Path, started: bool,
             refusing: str = weights.WORKER_REFUSES) -> list[str]:
    """Everything the probe's dump (``probe_meta``) and the server's ready marker say that is
    not the run's, each with its fix; empty when the server is the run's.

    Args:
        recorded: the manifest's weights identity (None: no manifest, or none recorded).
        local: FARM_MODEL_PATH's weights identity.
        started: hidden states of the run exist (its canary is recorded).
        refusing: what the caller does while the server is wrong (one sentence).
    """
    out = []
    why = weights.served_mismatch(served_weights(probe_meta), recorded, local,
                                  server_url=settings.server_url, model_path=model_path,
                                  manifest=manifest, started=started, refusing=refusing)
    if why:
        out.append(why)
    meta = dumps.identity_problems(probe_meta, fingerprint)
    if meta:
        out.append(f"the server at {settings.server_url} is not serving the run's model as the "
                   f"run captures it: {'; '.join(meta)}. {refusing} Restart the server with the "
                   "run's model and --layers-to-capture (the run's FARM_LAYERS_TO_CAPTURE), "
                   "or start a new run (a new FARM_OUTPUT_DIR) for the server's")
    dtype = dumps.served_dtype_problem(settings.dump_dir, settings.hidden_dtype,
                                       probe_meta.get(M_WRITER))
    if dtype:
        out.append(dtype)
    return out


def check(settings: Settings, fingerprint: Fingerprint, probe_meta: dict[str, str], *,
          recorded: dict[str, Any] | None, local: dict[str, Any] | None, model_path: Path,
          manifest: Path, started: bool, refusing: str = weights.WORKER_REFUSES) -> None:
    """``problems``, raised.

    Raises:
        ConfigError: the server is not the run's; every problem and its fix.
    """
    found = problems(settings, fingerprint, probe_meta, recorded=recorded, local=local,
                     model_path=model_path, manifest=manifest, started=started,
                     refusing=refusing)
    if found:
        raise ConfigError("\n".join(found))
