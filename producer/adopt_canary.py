"""Before ``adopt`` compares files with the server, the server must be the run's: the run's
canary (``worker/canary_check.py``), when one is recorded, is compared first, exactly as a
worker compares it at start-up. A run that has none yet (``adopt`` before any worker) is
guarded by the fingerprint and the weights identity that opened the output dir; the first
worker records the canary from the same server the check used.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from worker import canary as cn
from worker.canary_check import CanaryCheck, Outcome
from worker.chat import ChatTokenizer
from worker.client import ServerClient
from worker.settings import Settings
from worker.store import OutputStore


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
                        encode=lambda text: list(chat.tok(text, add_special_tokens=False)
                                                 ["input_ids"]))
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_run(check, settings))
    finally:
        loop.close()


async def _run(check: CanaryCheck, settings: Settings) -> Outcome:
    client = ServerClient(settings.server_url, settings.request_timeout_s)
    try:
        return await check.run(client)
    finally:
        await client.close()
