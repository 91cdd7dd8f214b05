"""Requests for the live tests: token ids, concurrent sends, and waiting for the dumps."""

from __future__ import annotations

import contextlib
import json
import random
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from engine_dump.dumpfile import dump_path, err_path
from engine_dump.rids import make_rid
from producer.localfarm.farm import wait_until
from tests.live.sglang_server import LiveServer

FIRST_ORDINARY_ID = 6  # the tiny tokenizer's special tokens come first


@dataclass(frozen=True)
class Req:
    """One request: its rid, prompt ids, and how many tokens it decodes (0: prefill only)."""

    rid: str
    ids: list[int]
    max_new_tokens: int = 0


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` ordinary token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]


def ours(key: str, n: int, seed: int, vocab: int, max_new_tokens: int = 0) -> Req:
    """A request of ours: a farm rid declaring its prompt length."""
    return Req(make_rid(key, 1, n), prompt(n, seed, vocab), max_new_tokens)


def send(server: LiveServer, reqs: list[Req], pool: ThreadPoolExecutor) -> list[Future[object]]:
    """Send every request at once (each on its own connection); futures of the answers."""
    return [pool.submit(server.generate, r.rid, r.ids, r.max_new_tokens) for r in reqs]


def wait_dump(dump_dir: Path, rid: str, timeout_s: float = 120) -> Path:
    """The request's dump once it is there; fails at once on a ``.err``."""
    dump, err = dump_path(dump_dir, rid), err_path(dump_dir, rid)

    def arrived() -> bool:
        assert not err.exists(), f"{rid}: {err.read_text()}"
        return dump.exists()

    wait_until(arrived, timeout_s, f"the dump of {rid}", poll_s=0.05)
    return dump


def log_lines_since(server: LiveServer, offset: int, pattern: str,
                    at_least: int = 0, timeout_s: float = 30.0) -> list[re.Match[str]]:
    """Matches of ``pattern`` in the server's log after byte ``offset``; with ``at_least``,
    once there are that many (or ``timeout_s`` passed): SGLang may log a batch after its
    forward, so its last line can land after the dump it made (a clean-clone run read 15 of a
    32k prompt's 16 chunk lines the moment its dump was there)."""
    def found() -> list[re.Match[str]]:
        text = server.log.read_bytes()[offset:].decode(errors="replace")
        return list(re.finditer(pattern, text))

    if at_least:
        with contextlib.suppress(TimeoutError):  # the caller's assertion says what is missing
            wait_until(lambda: len(found()) >= at_least, timeout_s, f"{at_least} log lines",
                       poll_s=0.2)
    return found()


PREFILL_LINE = (r"Prefill batch, #new-seq: (?P<seqs>\d+), #new-token: (?P<tokens>\d+).*?"
                r"#running-req: (?P<running>\d+)")
