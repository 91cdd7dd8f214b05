"""A sample's regeneration: which turns are answered, each turn's seed and policies, and the
record of what the served model said, rewritten durably after every turn
(``generated/<shard>/<key>.json``): a delivery after any crash resumes at the first turn it
lacks; a record of another run, record version or settings is replaced. docs/regeneration.md.
Test: tests/unit/test_generation.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine_dump.engines import FINISH_LENGTH, Decoded
from worker.core import durable, outdir
from worker.core.errors import BadInput, Corrupt
from worker.core.settings import GEN_VERSION, GenSettings
from worker.core.store import io_errors

log = logging.getLogger("hsfarm.regen")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # Qwen3's and Kimi-K2.5's reasoning tags


def seed_for(run_id: str, key: str, turn: int) -> int:
    """A turn's seed, from the run and the sample: a lost record is regenerated from the same
    random draws where the engine takes seeds (vLLM; SGLang only under
    --enable-deterministic-inference), the same tokens only where its numerics repeat too."""
    digest = hashlib.sha256(f"{run_id}/{key}/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1  # 31 bits: every engine's seed type takes it


def reply_positions(messages: Sequence[dict[str, str]]) -> list[int]:
    """Where the model's replies go: each assistant message right after a user message, and
    the end when the conversation ends with a user message."""
    out = [i for i in range(1, len(messages))
           if messages[i]["role"] == "assistant" and messages[i - 1]["role"] == "user"]
    if messages and messages[-1]["role"] == "user":
        out.append(len(messages))
    return out


@dataclass(frozen=True)
class Turn:
    """One regenerated assistant turn."""

    position: int  # its index in the regenerated conversation's messages
    prompt_tokens: int
    output_ids: list[int]  # as the engine returned them (a stop token that ended it included)
    finish: str  # engines.FINISH_STOP or FINISH_LENGTH
    matched: int | None  # the stop token, where the engine said
    seed: int
    content: str  # the reply as the conversation holds it (reasoning per FARM_GEN_REASONING)
    reasoning: str | None  # the part inside <think>...</think>; None: the reply has none

    def message(self, reasoning_policy: str) -> dict[str, str]:
        """The assistant message of this turn in the regenerated conversation."""
        msg = {"role": "assistant", "content": self.content}
        if reasoning_policy == "field" and self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        return msg


def make_turn(position: int, prompt_tokens: int, out: Decoded, seed: int, reasoning_policy: str,
              end_ids: frozenset[int], decode: Callable[[list[int]], str]) -> Turn:
    """A turn from the engine's answer: its text is its ids decoded, less a trailing stop or
    end-of-sequence token, split at ``</think>`` into reasoning and content."""
    ids = list(out.output_ids)
    if ids and out.finish != FINISH_LENGTH and (ids[-1] in end_ids or ids[-1] == out.matched):
        ids = ids[:-1]
    text = decode(ids)
    reasoning: str | None = None
    content = text
    if THINK_CLOSE in text:
        head, _, content = text.partition(THINK_CLOSE)
        reasoning = head.replace(THINK_OPEN, "", 1).strip("\n")
        content = content.lstrip("\n")
    if reasoning_policy == "keep":
        content = text  # the chat template places the reasoning as it places any reply's
    return Turn(position, prompt_tokens, list(out.output_ids), out.finish, out.matched, seed,
                content, reasoning)


def policy_problem(gs: GenSettings, turn: Turn, number: int) -> str | None:
    """Why ``turn`` (the ``number``-th regenerated) rejects its sample, per the run's
    policies; None when it is kept."""
    where = f"regenerated turn {number + 1} (message {turn.position})"
    if turn.finish == FINISH_LENGTH and gs.on_length == "reject":
        return (f"{where} was cut at {len(turn.output_ids)} tokens (FARM_GEN_MAX_NEW_TOKENS="
                f"{gs.max_new_tokens}, or the room FARM_MAX_TOKENS left); FARM_GEN_ON_LENGTH="
                "keep keeps such turns")
    if not turn.content.strip() and gs.on_empty == "reject":
        return (f"{where} is an empty reply ({len(turn.output_ids)} tokens); "
                "FARM_GEN_ON_EMPTY=keep keeps such turns")
    return None


@dataclass
class Record:
    """A sample's generation so far (the module's docstring)."""

    run: str
    key: str
    content_sha256: str
    generation: str  # GenSettings.identity()
    turns: list[Turn] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        body = {"version": GEN_VERSION, "run": self.run, "key": self.key,
                "content_sha256": self.content_sha256, "generation": self.generation,
                "turns": [asdict(t) for t in self.turns]}
        return {**body, "sha256": _digest(body)}

    @classmethod
    def from_json(cls, d: Any) -> Record:
        """Raises ValueError for anything but an intact record."""
        if not isinstance(d, dict) or d.get("version") != GEN_VERSION:
            raise ValueError("not a generation record of this version")
        body = {k: v for k, v in d.items() if k != "sha256"}
        if d.get("sha256") != _digest(body):
            raise ValueError("its checksum does not match its content")
        try:
            turns = [Turn(**t) for t in d["turns"]]
            return cls(str(d["run"]), str(d["key"]), str(d["content_sha256"]),
                       str(d["generation"]), turns)
        except (KeyError, TypeError) as e:
            raise ValueError(f"a field is missing or wrong: {e}") from e

    def conversation(self, messages: Sequence[dict[str, str]], positions: list[int],
                     reasoning_policy: str) -> list[dict[str, str]]:
        """``messages`` with each finished turn in its place (appended at the end)."""
        out = [dict(m) for m in messages]
        for turn in self.turns:
            msg = turn.message(reasoning_policy)
            if turn.position == len(out):
                out.append(msg)
            else:
                out[turn.position] = msg
        return out

    def metadata(self) -> str:
        """What the final file says of its conversation's generation (``M_GENERATION``)."""
        return json.dumps({"generation": json.loads(self.generation),
                           "turns": [asdict(t) for t in self.turns]},
                          sort_keys=True, separators=(",", ":"))


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def record_path(out_dir: Path, key: str) -> Path:
    return out_dir / outdir.GENERATED_DIR / outdir.shard_of(key) / f"{key}.json"


def load(out_dir: Path, run: str, key: str, content_sha256: str,
         generation: str) -> Record:
    """The sample's record as far as it goes; a new one where there is none, or where the one
    there is damaged or not this run's, this version's of the sample, these settings'."""
    fresh = Record(run, key, content_sha256, generation)
    path = record_path(out_dir, key)
    try:
        found = Record.from_json(json.loads(path.read_bytes()))
    except FileNotFoundError:
        return fresh
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        log.warning("%s generation record %s is unreadable (%s): regenerating it", key, path, e)
        return fresh
    ours = (found.run, found.key, found.content_sha256, found.generation) == (
        run, key, content_sha256, generation)
    if not ours:
        log.warning("%s generation record %s is of another run, record or settings: "
                    "regenerating it", key, path)
        return fresh
    return found


def save(out_dir: Path, record: Record) -> None:
    """Durably, then read back.

    Raises:
        NoSpace, OutputUnavailable: the output disk's (``store.io_errors``).
        Corrupt: the record does not read back as written.
    """
    path = record_path(out_dir, record.key)
    body = record.to_json()
    with io_errors(f"writing {path}", 1 << 20):
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.write_json(path, body)
        back = path.read_bytes()
    try:
        same = json.loads(back) == body
    except ValueError:
        same = False
    if not same:
        raise Corrupt(f"{path} does not read back as written")


def file_conversation(said: str | None, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation a regenerating run's final file says its states are of
    (``finalfile.M_MESSAGES``), checked against the record it was regenerated from: every
    message the run keeps is the record's, and the replies are where ``reply_positions``
    puts them.

    Raises:
        ValueError: the file holds no conversation, or one that is not of this record.
    """
    try:
        conv = json.loads(said) if said is not None else None
    except ValueError as e:
        raise ValueError(f"its conversation is not JSON: {e}") from e
    if not isinstance(conv, list) or not all(isinstance(m, dict) for m in conv):
        raise ValueError("it holds no regenerated conversation")
    positions = reply_positions(messages)
    want = len(messages) + (1 if positions and positions[-1] == len(messages) else 0)
    if len(conv) != want:
        raise ValueError(f"its conversation has {len(conv)} messages, the record's "
                         f"regenerated {want}")
    for i, m in enumerate(conv):
        if i in positions:
            if m.get("role") != "assistant" or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} is not a regenerated assistant turn")
        elif m != dict(messages[i]):
            raise ValueError(f"message {i} differs from the record's")
    return conv


def needs_messages(sample_input_ids: Sequence[int]) -> None:
    """Raises BadInput for a pre-tokenized record: there are no turns to answer."""
    if sample_input_ids:
        raise BadInput("a pre-tokenized record (input_ids) cannot be regenerated: its turns "
                       "are not known; give it as messages, or run without FARM_REGENERATE")
