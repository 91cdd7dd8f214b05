"""What a server's HTTP answer says: the sample's fault, or the environment's.

Only the engine's own 400 with its JSON error body (SGLang's and vLLM's shapes) is about the
sample, and not all of those: a duplicate rid, a length refusal (a configuration to fix,
``limits``) and a DP rank out of range are not. Everything else short of a success (a rate
limiter's 429, a gateway's page, 502-504 during a restart, the engine's 503, a non-JSON answer)
makes the worker wait, spending no attempt: when unsure, it is the environment.
Test: tests/unit/test_answers.py::test_only_the_engines_own_400_is_the_samples_fault."""

from __future__ import annotations

import re

import orjson

from worker.core.errors import (
    LENGTH_REFUSALS,
    BadInput,
    ConfigError,
    FarmError,
    ServerBusy,
    Transient,
)

# Answers of the server (or a gateway) that mean "not now": wait and try again.
BUSY_STATUSES = frozenset({408, 425, 429, 502, 503, 504})
_DUPLICATE_RID = "Duplicate request ID"
# SGLang's tokenizer_manager.py:921 "routed_dp_rank=... out of range [0, N)"; vLLM's
# input_processor.py:398 "data_parallel_rank N is out of range [0, M)."
_DP_RANK_REFUSALS = ("routed_dp_rank=", "data_parallel_rank ")


def error_for(what: str, status: int, body: bytes) -> FarmError | None:
    """The error an answer with ``status`` and ``body`` stands for; None for a success.

    BadInput: SGLang's 400 with its JSON error body, about the request's content. ConfigError:
    SGLang refuses the input's length (restart the worker, which re-reads it, or fix the server).
    ServerBusy: "not now" (429, 408, 502-504) and every other 4xx (a gateway's page, 413, 401...).
    Transient: another 5xx (500: a counted attempt, bounded), or a duplicate rid.
    """
    if 200 <= status < 300:
        return None
    message = sglang_error(body)
    where = f"server answered {what} with {status}"
    if message is None:  # not SGLang's body: a proxy, a gateway, a load balancer
        message = f"a body that is not the server's ({_excerpt(body)})"
    if status in BUSY_STATUSES:
        return ServerBusy(f"{where}: {message}", status)
    if status >= 500:  # the server failed on this request (maybe for it): bounded attempts
        return Transient(f"server error on {what} ({status}): {message}")
    if sglang_error(body) is None:
        return ServerBusy(f"{where}: {message}: a gateway or proxy in front of it refuses "
                          "for now", status)
    if status == 400 and _DUPLICATE_RID in message:
        return Transient(f"{where}: {message}")
    if status == 400 and any(m in message for m in LENGTH_REFUSALS):
        return ConfigError(f"{where}: {message}. The server takes fewer tokens than this "
                           "worker was sized for (it restarted with a shorter context?): the "
                           "worker stops; at its next start it checks the server's context "
                           "against FARM_MAX_TOKENS and says what to do")
    if status == 400 and any(m in message for m in _DP_RANK_REFUSALS):
        return ConfigError(f"{where}: {message}. The server has fewer DP groups than this "
                           "worker read at its start (restarted with another layout?): the "
                           "worker stops; at its next start it reads the groups again")
    if status == 400:
        return BadInput(f"server rejected the sample ({status}): {message}")
    return ServerBusy(f"{where}: {message}", status)  # 401, 403, 404, 413...: not the sample


def sglang_error(body: bytes) -> str | None:
    """The message of SGLang's JSON error body, None when the body is not one.

    SGLang answers ``{"object": "error", "message": ...}`` (OpenAI style) or
    ``{"error": {"message": ...}}``; a gateway answers HTML, plain text or its own JSON.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    err = doc.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    if doc.get("object") == "error" and isinstance(doc.get("message"), str):
        return str(doc["message"])
    return None


def _excerpt(body: bytes) -> str:
    text = body[:2000].decode("utf-8", "replace")
    title = re.search(r"<title>(.*?)</title>", text, re.I | re.S)
    text = title.group(1) if title else text
    return " ".join(text.split())[:120] or "empty"

