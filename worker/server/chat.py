"""Tokenize a sample with the served model's tokenizer and chat template; build the loss mask.

The mask covers what each assistant message adds after its generation prompt, found by
rendering the template incrementally as vLLM's speculators do (``_mask_by_prefixes`` where the
tokenizer gives no offsets); a template that does not render a conversation as a prefix of its
continuation is reported per sample, never guessed. A missing jinja2 or a template that does not
compile is the environment's (``ConfigError``); only a conversation it refuses is ``BadInput``.
Test: tests/unit/test_chat.py::test_tokenizers_without_offsets_get_the_same_mask."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.core.errors import SERVER_CONTEXT, BadInput, ConfigError
from worker.core.samples import Sample

# Rendered once at start-up: any chat template must accept a plain two-turn conversation.
PROBE_CONVERSATION = ({"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": "Hi there."})
_ENGINE_FIX = ("install the worker's dependencies into its environment "
               "(pip install hsfarm[worker]; chat templates need jinja2>=3.1.6)")


MIN_TOKENS = 2  # EAGLE-3 trainers shift by one; SpecForge's squeeze breaks on T = 1


@dataclass(frozen=True)
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    truncated_from: int = 0  # original length when truncated, else 0


class ChatTokenizer:
    """Wraps a Hugging Face tokenizer with the run's length policy.

    Args:
        offsets: place the mask by character offsets (default: when the tokenizer is fast);
            else by tokenizing prefixes.
    """

    def __init__(self, tokenizer: Any, max_tokens: int, overlong: str,
                 offsets: bool | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the served model's tokenizer has no chat template")
        self.tok = tokenizer
        self.offsets = bool(getattr(tokenizer, "is_fast", False)) if offsets is None else offsets
        self.max_tokens = max_tokens
        self.overlong = overlong
        # The server's own limit when it takes fewer (truncate only: server_limits.py)
        self.server_max_tokens: int | None = None
        self.vocab_size = len(tokenizer)
        # what ends a generated turn: the tokenizer's end of sequence, and the model's
        # (``from_pretrained`` adds its config's and generation config's)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.end_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else [])
        self._check_template()

    def _check_template(self) -> None:
        """Render the probe conversation: a broken template or engine stops the process now,
        before any sample could be blamed for it."""
        try:
            self._render(list(PROBE_CONVERSATION), gen_prompt=False)
        except BadInput as e:
            raise ConfigError(f"the served model's chat template cannot render a plain "
                              f"user/assistant conversation ({e}); fix the template "
                              "(chat_template.jinja or tokenizer_config.json)") from e

    @classmethod
    def from_pretrained(cls, path: str, max_tokens: int, overlong: str,
                        trust_remote_code: bool = False) -> ChatTokenizer:
        # A worker has no torch on purpose (it only tokenizes); transformers' advice that
        # "PyTorch was not found" at import would be noise in every worker's log.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except ImportError as e:
            raise ConfigError(f"the tokenizer at {path} needs a library this environment "
                              f"lacks: {e}") from e
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load the tokenizer from {path}: {e}") from e
        chat = cls(tok, max_tokens, overlong)
        chat.end_ids = chat.end_ids | _model_eos_ids(Path(path))
        return chat

    def encode(self, sample: Sample) -> Tokenized:
        """Raises BadInput (template refusal, length, vocabulary) with the reason, or
        ConfigError when the template engine or the template itself is broken."""
        if sample.input_ids:
            ids, mask = list(sample.input_ids), list(sample.loss_mask)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise BadInput(f"input_ids contains {bad}, outside the vocabulary "
                               f"(size {self.vocab_size})")
        else:
            ids, mask = self._encode_messages(list(sample.messages))
        return self._fit(ids, mask)

    def conversation_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation's token ids exactly as a sample's (the chat template, its special
        tokens, the same tokenizer call), without the run's length policy: the canary's.

        Raises:
            BadInput: the template refuses the conversation.
            ConfigError: the template engine or the template is broken.
        """
        return self._encode_messages(messages)[0]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids that ask the model for the next assistant turn of ``messages``: the chat
        template with its generation prompt, tokenized as a sample is (no length policy).

        Raises:
            BadInput: the template refuses the conversation.
            ConfigError: the template engine or the template is broken.
        """
        return self._ids(self._render(messages, gen_prompt=True))

    def decode(self, ids: list[int]) -> str:
        """A generated turn's text, every token kept (``<think>`` may be a special token)."""
        return str(self.tok.decode(ids, skip_special_tokens=False))

    def _render(self, messages: list[dict[str, str]], gen_prompt: bool) -> str:
        """Raises ConfigError (engine missing, template broken) or BadInput (refused)."""
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=gen_prompt)
        except ImportError as e:
            raise ConfigError(f"cannot render the chat template: {e}; {_ENGINE_FIX}") from e
        except Exception as e:  # jinja raises anything (TemplateError, TypeError, ...)
            if _is_template_syntax_error(e):
                raise ConfigError(f"the served model's chat template does not compile: {e}; "
                                  "fix chat_template.jinja or tokenizer_config.json") from e
            raise BadInput(f"chat template rejected the conversation: {e}") from e
        return str(text)

    def _assistant_spans(self, messages: list[dict[str, str]], full: str) -> list[range]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:i], gen_prompt=True) if i else ""
            upto = self._render(messages[: i + 1], gen_prompt=False)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise BadInput(
                    f"chat template is not prefix-stable at message {i}: rendering the "
                    "conversation up to it is not a prefix of the whole; cannot place the "
                    "loss mask"
                )
            spans.append(range(len(before), len(upto)))
        return spans

    def _encode_messages(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        full = self._render(messages, gen_prompt=False)
        spans = self._assistant_spans(messages, full)
        ids, mask = (self._mask_by_offsets if self.offsets else self._mask_by_prefixes)(
            full, spans)
        if not any(mask):
            raise BadInput("assistant turns are empty after templating: nothing to train on")
        return ids, mask

    def _mask_by_offsets(self, full: str, spans: list[range]) -> tuple[list[int], list[int]]:
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = list(enc["input_ids"])
        mask = [0] * len(ids)
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            if end > start and any(start in s for s in spans):
                mask[t] = 1
        return ids, mask

    def _mask_by_prefixes(self, full: str, spans: list[range]) -> tuple[list[int], list[int]]:
        """For tokenizers without offsets: a turn's tokens are those the text through it adds
        to the text before it, when the whole conversation tokenizes to the same prefixes."""
        ids = self._ids(full)
        mask = [0] * len(ids)
        for span in spans:
            before, upto = self._ids(full[: span.start]), self._ids(full[: span.stop])
            if upto[: len(before)] != before or ids[: len(upto)] != upto:
                raise BadInput(f"the tokenizer does not split the conversation at the assistant "
                               f"turn starting at character {span.start} as it splits the "
                               "text before it; cannot place the loss mask")
            mask[len(before) : len(upto)] = [1] * (len(upto) - len(before))
        return ids, mask

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _fit(self, ids: list[int], mask: list[int]) -> Tokenized:
        n = len(ids)
        limit = min(self.max_tokens, self.server_max_tokens or self.max_tokens)
        if n <= limit:
            return _at_least_two(Tokenized(ids, mask))
        if self.overlong == "reject" and n > self.max_tokens:
            raise BadInput(f"sample has {n} tokens, over the maximum of {self.max_tokens} "
                           "(FARM_MAX_TOKENS; FARM_OVERLONG=truncate keeps the first part)")
        whole_mask, ids, mask = mask, ids[:limit], mask[:limit]
        if not any(mask):
            if limit < self.max_tokens and any(whole_mask[: self.max_tokens]):
                raise BadInput(f"sample has {n} tokens; truncated to {limit}, {SERVER_CONTEXT} "
                               f"(under FARM_MAX_TOKENS={self.max_tokens}), it has no "
                               "assistant tokens left")
            raise BadInput(f"sample has {n} tokens; truncated to {limit} it has no "
                           "assistant tokens left")
        return _at_least_two(Tokenized(ids, mask, truncated_from=n))


def _model_eos_ids(model_path: Path) -> frozenset[int]:
    """``eos_token_id`` (an id or a list) of the model's config.json and
    generation_config.json, as the engines read it; what a file lacks adds nothing."""
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            said = json.loads((model_path / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        out.update(i for i in (said if isinstance(said, list) else [said]) if type(i) is int)
    return frozenset(out)


def _at_least_two(tok: Tokenized) -> Tokenized:
    """Raises BadInput for a sample of fewer than ``MIN_TOKENS`` tokens."""
    n = len(tok.input_ids)
    if n < MIN_TOKENS:
        raise BadInput(f"sample has {n} token{'' if n == 1 else 's'}, fewer than {MIN_TOKENS}: "
                       "the trainers predict token t+1 from token t, so their shift by one "
                       "(and SpecForge's squeeze) leave nothing to train on")
    return tok


def _is_template_syntax_error(e: Exception) -> bool:
    """A jinja2 compile error (also when jinja2 itself cannot be imported here)."""
    return any(cls.__name__ == "TemplateSyntaxError" and cls.__module__.startswith("jinja2")
               for cls in type(e).__mro__)
