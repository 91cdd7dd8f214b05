"""What a server's answer says about a sample: only the engine's own 400 is the sample's fault."""

from __future__ import annotations

import json

import pytest

from tests.support.faults import NGINX_413, NGINX_429, NGINX_502
from worker.core.errors import BadInput, ConfigError, ServerBusy, Transient, environmental_rejection
from worker.server.answers import error_for


def sglang(message: str) -> bytes:
    """SGLang's error body (OpenAI style), as its /generate answers a bad request."""
    return json.dumps({"object": "error", "message": message, "type": "BadRequestError",
                       "param": None, "code": 400}).encode()


def older_sglang(message: str) -> bytes:
    return json.dumps({"error": {"message": message}}).encode()


def vllm(message: str, status: int = 400, kind: str = "BadRequestError") -> bytes:
    """vLLM 0.32's error body (``serve/exception_handling/error_response.py``)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()


@pytest.mark.parametrize(("status", "body", "kind"), [
    # the sample's content: SGLang's 400 with its JSON body
    (400, sglang("The input_ids 99999 is out of vocabulary range [0, 1000)."), BadInput),
    (400, older_sglang("Either text or input_ids should be provided."), BadInput),
    # a gateway's or rate limiter's answer, whatever its status: not the sample's
    (429, NGINX_429.encode(), ServerBusy),
    (429, sglang("rate limited"), ServerBusy),
    (429, b'{"message": "API rate limit exceeded"}', ServerBusy),  # Kong's JSON
    (413, NGINX_413.encode(), ServerBusy),
    (400, b"<html><head><title>400 Request Header Or Cookie Too Large</title>", ServerBusy),
    (400, b"Bad Request", ServerBusy),
    (502, NGINX_502.encode(), ServerBusy),
    (503, sglang("The server is not ready"), ServerBusy),
    (504, b"", ServerBusy),
    (404, b"404 page not found", ServerBusy),
    (403, sglang("forbidden"), ServerBusy),
    # SGLang's own: an internal error (counted), a rid still running (retried)
    (500, sglang("CUDA error"), Transient),
    (500, b"Internal Server Error", Transient),  # starlette's, for an unhandled exception
    (400, sglang("Duplicate request ID hsd-a-a1-n9"), Transient),
    # the server's context is shorter than the worker was sized for: a configuration
    (400, sglang("The input (2101 tokens) is longer than the model's context length "
                 "(1024 tokens)."), ConfigError),
    (400, sglang("Input length (1030 tokens) exceeds the maximum allowed length (1018 "
                 "tokens). Use a shorter input or enable --allow-auto-truncate."), ConfigError),
    # a pinned DP group the server no longer has (restarted with fewer): a configuration
    (400, older_sglang("routed_dp_rank=3 out of range [0, 2)"), ConfigError),
    # vLLM's own: the sample's content, a configuration, its engine's state
    (400, vllm("Token id 99999 is out of vocabulary"), BadInput),
    (400, vllm("The decoder prompt cannot be empty"), BadInput),
    (400, vllm("This model's maximum context length is 2048 tokens. However, your prompt "
               "contains 2100 input tokens, which exceeds this limit even without any "
               "output tokens. Please reduce the length of the input prompt."), ConfigError),
    (400, vllm("The decoder prompt (length 2048) plus the number of requested output tokens "
               "(at least 1) is longer than the maximum model length of 2048. Make sure that "
               "`max_model_len` is no smaller than the number of text tokens (prompt + "
               "requested output tokens)."), ConfigError),
    # a prompt exactly max_model_len long: no room for the one token the farm asks (vLLM's
    # get_max_tokens gives 0, SamplingParams refuses it), as a server restarted shorter says
    (400, vllm("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
     ConfigError),
    (400, vllm("data_parallel_rank 2 is out of range [0, 2)."), ConfigError),
    (404, vllm("The model `kimi` does not exist.", 404, "NotFoundError"), ServerBusy),
    (503, vllm("engine is sleeping", 503, "ServiceUnavailableError"), ServerBusy),
    (500, vllm("EngineCore encountered an issue", 500, "InternalServerError"), Transient),
])
def test_only_the_engines_own_400_is_the_samples_fault(status: int, body: bytes,
                                                   kind: type) -> None:
    err = error_for("/generate", status, body)
    assert type(err) is kind, err
    if isinstance(err, ServerBusy):
        assert err.status == status


def test_a_success_is_no_error() -> None:
    assert error_for("/generate", 200, b"{}") is None


def test_a_gateways_page_is_named_by_its_title() -> None:
    err = error_for("/generate", 429, NGINX_429.encode())
    assert "(429 Too Many Requests)" in str(err) and "<html>" not in str(err)


@pytest.mark.parametrize(("reason", "environmental"), [
    # what older versions recorded for any 4xx: retried once, the new client tells them apart
    ("server rejected /generate (429): <html>\r\n<head><title>429 Too Many Requests", True),
    ("server rejected /generate (413): <html>", True),
    ("server rejected /generate (400): The input (2101 tokens) is longer than the model's "
     "context length (1024 tokens).", True),
    ("server rejected the sample (400): max_tokens must be at least 1, got 0. "
     "(parameter=max_tokens, value=0)", True),
    ("sample has 300 tokens; truncated to 153, what the server's context takes (under "
     "FARM_MAX_TOKENS=8192), it has no assistant tokens left", True),
    # the sample's own content
    ("server rejected the sample (400): The input_ids 99999 is out of vocabulary range", False),
    ("sample has 9000 tokens, over the maximum of 8192 (FARM_MAX_TOKENS; ...)", False),
    ("no assistant turn", False),
])
def test_environmental_rejection(reason: str, environmental: bool) -> None:
    assert environmental_rejection(reason) is environmental
