"""Tokenization with the chat template and the assistant-only loss mask."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from worker.core.errors import BadInput, ConfigError
from worker.core.samples import Sample
from worker.server.chat import ChatTokenizer


def _chat(tokenizer: Any, max_tokens: int = 8192, overlong: str = "reject") -> ChatTokenizer:
    return ChatTokenizer(tokenizer, max_tokens, overlong)


def _sample(*turns: tuple[str, str]) -> Sample:
    return Sample(source_id=None, messages=tuple({"role": r, "content": t} for r, t in turns))


def test_mask_covers_exactly_the_assistant_turns(tokenizer: Any) -> None:
    # Given a multi-turn conversation with a system prompt
    s = _sample(("system", "Be brief."), ("user", "Hi there"), ("assistant", "Hello! 你好"),
                ("user", "2+2?"), ("assistant", "  4, of course.  "))
    # When tokenized
    tok = _chat(tokenizer).encode(s)
    # Then the masked tokens decode to the assistant contents and their end-of-turn markers
    masked = [t for t, m in zip(tok.input_ids, tok.loss_mask, strict=True) if m]
    assert tokenizer.decode(masked) == "Hello! 你好<|eot_id|>4, of course.<|eot_id|>"
    unmasked = [t for t, m in zip(tok.input_ids, tok.loss_mask, strict=True) if not m]
    assert "Hi there" in tokenizer.decode(unmasked)
    assert tok.input_ids == tokenizer.apply_chat_template(list(s.messages), tokenize=True,
                                                          return_dict=False)


def test_tokenizers_without_offsets_get_the_same_mask(tokenizer: Any) -> None:
    # Given every example conversation, masked by character offsets (a fast tokenizer) and by
    # tokenizing prefixes (what a tokenizer without offsets, such as Kimi-K2.5's, gets)
    import json

    from tests.conftest import EXAMPLES
    from worker.core.samples import validate_record

    by_offsets = _chat(tokenizer)
    by_prefixes = ChatTokenizer(tokenizer, 8192, "reject", offsets=False)
    assert by_offsets.offsets and not by_prefixes.offsets
    samples = [validate_record(r) for r in json.loads(EXAMPLES.read_text())]
    # Then both give the same ids and the same mask, sample by sample
    for sample in samples:
        assert by_prefixes.encode(sample) == by_offsets.encode(sample), sample.source_id


def test_overlong_rejected_or_truncated(tokenizer: Any) -> None:
    s = _sample(("user", "x " * 50), ("assistant", "y " * 50))
    full = _chat(tokenizer).encode(s)
    prompt_len = full.loss_mask.index(1)
    with pytest.raises(BadInput, match=f"over the maximum of {prompt_len}"):
        _chat(tokenizer, prompt_len).encode(s)
    # truncation that keeps no assistant token is a rejection too
    with pytest.raises(BadInput, match="no assistant tokens left"):
        _chat(tokenizer, prompt_len, "truncate").encode(s)
    tok = _chat(tokenizer, prompt_len + 5, "truncate").encode(s)
    assert tok.input_ids == full.input_ids[: prompt_len + 5]
    assert sum(tok.loss_mask) == 5 and tok.truncated_from == len(full.input_ids)


def test_pretokenized_samples_are_checked_against_the_vocabulary(tokenizer: Any) -> None:
    ok = Sample(source_id=1, input_ids=(1, 2, 3), loss_mask=(0, 1, 1))
    assert _chat(tokenizer).encode(ok).loss_mask == [0, 1, 1]
    bad = Sample(source_id=1, input_ids=(1, 10**6), loss_mask=(1, 1))
    with pytest.raises(BadInput, match="outside the vocabulary"):
        _chat(tokenizer).encode(bad)


def test_empty_assistant_turn_has_nothing_to_train(tokenizer: Any) -> None:
    # the end-of-turn marker is still an assistant token, so only a template without one
    # could produce an empty mask; the tiny template keeps <|eot_id|>
    tok = _chat(tokenizer).encode(_sample(("user", "q"), ("assistant", "")))
    assert sum(tok.loss_mask) == 1


def _with_template(model_dir: Path, template: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = template
    return tok


def test_a_template_that_does_not_compile_is_a_config_error_at_start(tiny_model: Path) -> None:
    # Given the served model's tokenizer with a template that has a syntax error
    tok = _with_template(tiny_model, "{% for m in messages %}{{ m['content'] }")
    # When the worker loads it, Then it stops with the fix, before any sample is blamed
    with pytest.raises(ConfigError, match=r"chat template does not compile.*fix chat_template"):
        _chat(tok)


def test_a_conversation_the_template_refuses_is_still_bad_input(tiny_model: Path) -> None:
    # Given a template that legitimately refuses system messages (as some models' do)
    tok = _with_template(tiny_model, "{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    chat = _chat(tok)  # a plain conversation renders: the template itself is fine
    # When a sample with a system message is encoded, Then that sample alone is rejected
    with pytest.raises(BadInput, match="System role not supported"):
        chat.encode(_sample(("system", "x"), ("user", "q"), ("assistant", "a")))


_WITHOUT_JINJA2 = """
import sys
sys.modules["jinja2"] = None  # to every importer, exactly as if jinja2 were not installed
from worker.server.chat import ChatTokenizer
from worker.core.errors import ConfigError
try:
    ChatTokenizer.from_pretrained(sys.argv[1], 8192, "reject")
except ConfigError as e:
    print(f"ConfigError: {e}")
"""


def test_a_missing_jinja2_is_a_config_error_naming_the_fix(tiny_model: Path) -> None:
    # Given a worker process in which jinja2 cannot be imported
    # When it loads the served model's tokenizer (worker and producer start-up)
    out = subprocess.run([sys.executable, "-c", _WITHOUT_JINJA2, str(tiny_model)],
                         capture_output=True, text=True, timeout=120)
    # Then it stops with a ConfigError that says what to install, never BadInput
    assert out.stdout.startswith("ConfigError: cannot render the chat template"), out
    assert "jinja2" in out.stdout and "pip install hsfarm" in out.stdout


def test_fewer_than_two_tokens_is_rejected_with_the_reason(tokenizer: Any) -> None:
    # Given pre-tokenized samples of one token and of two tokens
    one = Sample(source_id=1, input_ids=(5,), loss_mask=(1,))
    two = Sample(source_id=2, input_ids=(5, 6), loss_mask=(0, 1))
    # When tokenized, Then one token is rejected, saying why, and two tokens pass
    with pytest.raises(BadInput, match="sample has 1 token, fewer than 2: the trainers"):
        _chat(tokenizer).encode(one)
    assert _chat(tokenizer).encode(two).input_ids == [5, 6]
    # And truncation to a single token is rejected the same way
    with pytest.raises(BadInput, match="fewer than 2"):
        _chat(tokenizer, 1, "truncate").encode(Sample(source_id=3, input_ids=(5, 6),
                                                      loss_mask=(1, 1)))
