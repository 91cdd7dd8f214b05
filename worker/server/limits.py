"""The longest input the server takes, checked against ``FARM_MAX_TOKENS`` at start-up.

SGLang refuses n input tokens when n >= its context length or n >= ``max_req_input_len``
(``min(context length - 1, KV pool - 1) - 5``); ``/server_info`` carries both, and a
prefill-only request needs no room for generated tokens. A server that takes fewer than
``FARM_MAX_TOKENS`` would refuse valid samples: ``FARM_OVERLONG=reject`` refuses to start with
the fix, ``truncate`` cuts samples to fit (each file records the length it was cut from).
Test: tests/unit/test_server_limits.py::test_a_short_server_context_is_refused_with_reject."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from worker.core.errors import BadInput, ConfigError, FarmError, ServerBusy
from worker.core.settings import Settings
from worker.server.answers import BUSY_STATUSES
from worker.server.client import ServerClient

log = logging.getLogger("hsfarm.worker")

# SGLang's scheduler keeps 5 tokens of max_req_input_len in reserve below context - 1.
SGLANG_RESERVED_TOKENS = 6


def max_input_tokens(info: dict[str, Any] | None) -> int | None:
    """The most tokens one request may hold for this server; None when it does not say."""
    info = info or {}
    limits = []
    for name in ("max_req_input_len", "context_length"):
        value = info.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            limits.append(value - 1)  # SGLang refuses n >= the limit
    return min(limits) if limits else None


def server_info(settings: Settings, wait_s: float = 0.0) -> dict[str, Any] | None:
    """The server's ``/server_info``, waiting up to ``wait_s`` while it does not answer (or a
    gateway refuses for now); None when it does not serve one. Its context only: no ready
    marker is read (vLLM says its context in ``/v1/models``; admission reads the rest)."""
    async def ask() -> dict[str, Any] | None:
        client = ServerClient(settings.server_url, 10.0)
        t0, said = time.monotonic(), -math.inf
        try:
            while True:
                try:
                    return await client.server_info()
                except (BadInput, ServerBusy) as e:
                    if not isinstance(e, ServerBusy) or e.status not in BUSY_STATUSES:
                        return None  # it answers, but has no /server_info
                    err: FarmError = e
                except FarmError as e:
                    err = e
                if time.monotonic() > t0 + wait_s:
                    return None
                if time.monotonic() - said > 30:
                    said = time.monotonic()
                    log.warning("waiting for the server at %s to answer /server_info (%.0fs so "
                                "far; loading the model?): %s", settings.server_url, said - t0,
                                err)
                await asyncio.sleep(1.0)
        finally:
            await client.close()

    return asyncio.run(ask())


def server_max_tokens(settings: Settings, info: dict[str, Any] | None) -> int | None:
    """The cut the run makes beyond ``FARM_MAX_TOKENS``: None when the server takes every
    sample the settings allow (or does not say what it takes).

    Raises:
        ConfigError: the server takes fewer tokens and ``FARM_OVERLONG`` is ``reject``.
    """
    limit = max_input_tokens(info)
    if limit is None:
        log.warning("the server at %s does not say how long an input it takes (no "
                    "max_req_input_len in /server_info): FARM_MAX_TOKENS=%d is not checked "
                    "against it", settings.server_url, settings.max_tokens)
        return None
    if limit >= settings.max_tokens:
        return None
    what = (f"the server at {settings.server_url} takes at most {limit} tokens per request "
            f"(/server_info: max_req_input_len {info and info.get('max_req_input_len')}, "
            f"context_length {info and info.get('context_length')}), fewer than "
            f"FARM_MAX_TOKENS={settings.max_tokens}")
    fix = (f"restart the server with --context-length "
           f"{settings.max_tokens + SGLANG_RESERVED_TOKENS + 1} or more (and KV cache room "
           f"for it), or set FARM_MAX_TOKENS={limit} (another run)")
    if settings.overlong == "reject":
        raise ConfigError(f"{what}: samples longer would be refused. Either {fix}, or set "
                          f"FARM_OVERLONG=truncate to cut them to {limit} tokens")
    log.warning("%s: with FARM_OVERLONG=truncate, samples are cut to %d tokens; to keep "
                "them whole, %s", what, limit, fix)
    return limit
