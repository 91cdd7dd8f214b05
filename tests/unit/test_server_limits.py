"""The longest input the server takes, against FARM_MAX_TOKENS (pure; the farm's side is in
test_env_faults.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.core.errors import BadInput, ConfigError
from worker.core.samples import Sample
from worker.core.settings import Settings
from worker.server.chat import ChatTokenizer
from worker.server.limits import max_input_tokens, server_max_tokens


def test_max_input_tokens_from_server_info() -> None:
    # SGLang refuses n >= max_req_input_len and n >= context_length (when the flag is set)
    assert max_input_tokens({"max_req_input_len": 1018, "context_length": None}) == 1017
    assert max_input_tokens({"max_req_input_len": 4000, "context_length": 1024}) == 1023
    assert max_input_tokens({"chunked_prefill_size": 8192}) is None
    assert max_input_tokens(None) is None


def test_a_short_server_context_is_refused_with_reject() -> None:
    s = Settings(max_tokens=4096)
    with pytest.raises(ConfigError) as e:
        server_max_tokens(s, {"max_req_input_len": 1018})
    assert "--context-length 4103 or more" in str(e.value)
    assert "FARM_MAX_TOKENS=1017" in str(e.value) and "FARM_OVERLONG=truncate" in str(e.value)


def test_a_short_server_context_cuts_with_truncate() -> None:
    s = Settings(max_tokens=4096, overlong="truncate")
    assert server_max_tokens(s, {"max_req_input_len": 1018}) == 1017
    assert server_max_tokens(s, {"max_req_input_len": 5000}) is None  # takes every sample
    assert server_max_tokens(s, {}) is None  # does not say: not checked


def test_chat_cuts_to_the_servers_limit(tiny_model: Path) -> None:
    chat = ChatTokenizer.from_pretrained(str(tiny_model), 4096, "truncate")
    msgs = ({"role": "user", "content": "hi " * 10},
            {"role": "assistant", "content": "ok " * 200})
    sample = Sample(source_id="s", messages=msgs)
    whole = chat.encode(sample)
    chat.server_max_tokens = 50
    cut = chat.encode(sample)
    assert cut.input_ids == whole.input_ids[:50] and cut.truncated_from == len(whole.input_ids)
    # a cut that leaves no assistant tokens only because of the server: its reason says so
    chat.server_max_tokens = 5
    with pytest.raises(BadInput, match="what the server's context takes"):
        chat.encode(sample)
