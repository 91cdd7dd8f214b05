"""Tokenization with the chat template and the assistant-only loss mask."""

from __future__ import annotations

from typing import Any

import pytest

from worker.chat import ChatTokenizer
from worker.errors import BadInput
from worker.samples import Sample


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
