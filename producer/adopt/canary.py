"""Before ``adopt`` compares files with the server, the server must be the run's, checked as
a worker checks it at start-up. First, before any source file is read and anything is
written: one probe request's dump says which weights the server serves, which layers it
captures, its config and dtype, compared with the run's manifest and FARM_MODEL_PATH
(``worker.server.served_identity``, the worker's own check). Then the run's canary
(``worker/server/canary_check.py``), when one is recorded. A run that has none yet (``adopt`` before
any worker) is guarded by the served identity; the first worker records the canary from the
same server the check used.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engine_dump.fingerprint import Fingerprint
from worker.core import canary as cn
from worker.core import manifest as manifests
from worker.core import outdir, weights
from worker.core.errors import ConfigError
from worker.core.settings import Settings
from worker.core.store import OutputStore
from worker.server import served_identity
from worker.server.canary_check import CanaryCheck, Outcome, chat_encoder
from worker.server.chat import ChatTokenizer
from worker.server.client import ServerClient

ADOPT_REFUSES = "Nothing was adopted."
PROBE_TIMEOUT_S = 60.0
PROBE_TRIES = 3  # a busy server may miss one probe's dump deadline


def served_check(settings: Settings, fingerprint: Fingerprint, model_path: Path) -> str:
    """The server is the run's (``worker.server.served_identity``), asked with one probe request;
    what the probe found (one line).

    Raises:
        ConfigError: the server does not answer the probe, or it serves another checkpoint,
            other layers, config or dtype than the run; the fix. Nothing was read or written.
    """
    from engine_dump.dumpdir import DumpDirUnsafe
    from engine_dump.probe import ProbeFailed, probe

    manifest = settings.output_dir / outdir.MANIFEST
    local = weights.weights_identity(model_path)
    for attempt in range(1, PROBE_TRIES + 1):
        try:
            result = probe(settings.server_url, settings.dump_dir,
                           timeout_s=min(PROBE_TIMEOUT_S, settings.dump_timeout_s))
            break
        except (ProbeFailed, DumpDirUnsafe) as e:
            if attempt == PROBE_TRIES or isinstance(e, DumpDirUnsafe):
                raise ConfigError(f"the server at {settings.server_url} cannot show which model "
                                  f"it serves: {e}. {ADOPT_REFUSES}") from e
    served_identity.check(settings, fingerprint, result.metadata,
                          recorded=_recorded_weights(manifest), local=local,
                          model_path=model_path, manifest=manifest,
                          started=cn.path_in(settings.output_dir).exists(),
                          refusing=ADOPT_REFUSES)
    return result.summary


def _recorded_weights(manifest: Path) -> dict[str, Any] | None:
    """The manifest's weights identity; None when there is no manifest or it records none."""
    try:
        return manifests.recorded_weights(manifests.read(manifest.parent))
    except (OSError, ConfigError):
        return None


def canary_outcome(settings: Settings, store: OutputStore, model_path: Path,
                   chat: ChatTokenizer) -> Outcome | None:
    """The run's canary compared with the server; None when the run has none recorded.

    Raises:
        Transient, Corrupt: the server could not answer the canary's prompts.
        ConfigError: the recording is damaged.
    """
    if not cn.path_in(store.out_dir).exists():
        return None
    check = CanaryCheck(settings, store.out_dir, model_path, store.fingerprint,
                        store.weights_id, run_id=store.run_id,
                        encode=chat_encoder(chat))
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_run(check, settings))
    finally:
        loop.close()


async def _run(check: CanaryCheck, settings: Settings) -> Outcome:
    client = ServerClient.of(settings)
    try:
        return await check.run(client)
    finally:
        await client.close()
