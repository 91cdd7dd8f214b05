"""When and how a worker runs the canary (``canary.py``): through the server, like a sample.

A worker checks at start-up, after a server outage or restart, and every
``FARM_CANARY_INTERVAL_S``; a mismatch pauses consumption (messages stay queued, nothing fails)
until a check every ``FARM_PAUSE_POLL_S`` passes. A mismatch is only what the comparison finds:
failing prompts are retried with backoff and an unfinished check is "could not be checked", so
a flaky server slows the farm, never stops it. A host's processes take turns (a Redis lease).
Test: tests/farm/test_canary.py::test_a_flaky_server_slows_the_farm_but_never_stops_it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine_dump import markers
from engine_dump.dumpfile import (
    AUX_LAYERS,
    M_LAYERS,
    M_SERVER_VERSION,
    T_AUX,
    T_HIDDEN,
    T_INPUT_IDS,
    dump_path,
    err_path,
)
from engine_dump.fingerprint import Fingerprint
from engine_dump.rids import NO_RUN, make_rid
from worker.core import canary as cn
from worker.core import liveness, tensorfile
from worker.core.dumps import identity_problems, open_file, wait_for_dump
from worker.core.errors import (
    BadInput,
    ConfigError,
    Corrupt,
    ServerUnavailable,
    Transient,
    server_silent,
)
from worker.core.settings import Settings
from worker.server.chat import ChatTokenizer
from worker.server.client import ServerClient
from worker.state import lease as leases
from worker.state.index import RunIndex
from worker.state.verdicts import MISMATCH, OK, Verdicts

log = logging.getLogger("hsfarm.canary")
Encode = Callable[[cn.Messages], list[int]]
PROMPT_TRIES = 5  # requests per canary prompt within one check, with backoff between
CANARY_KEY_PREFIX = "_hsfarm_canary"


def chat_encoder(chat: ChatTokenizer) -> Encode:
    """The canary's conversations tokenized as samples are; a template that refuses a system
    turn (some do) gets the conversation without it.

    The encoder raises ConfigError when the template refuses the conversation even so: the
    canary cannot be recorded with it, which a person must look at.
    """
    def encode(messages: cn.Messages) -> list[int]:
        try:
            return chat.conversation_ids(messages)
        except BadInput as first:
            if messages and messages[0]["role"] == "system":
                with contextlib.suppress(BadInput):
                    return chat.conversation_ids(messages[1:])
            raise ConfigError(f"the chat template refuses the canary's conversation ({first}): "
                              "fix the template (chat_template.jinja or "
                              "tokenizer_config.json)") from first
    return encode


def canary_key(i: int) -> str:
    """The sample key of canary prompt ``i``'s request: it names the sending process and its
    machine, so the janitor can sweep the dumps of a checker that was killed mid-check."""
    return (f"{CANARY_KEY_PREFIX}{i}_m{liveness.MACHINE or 'unknown'}_{os.getpid()}_"
            f"{uuid.uuid4().hex[:8]}")


def canary_writer_gone(key: str) -> bool:
    """True when ``key`` is a canary request of a process of this machine that is gone."""
    if not key.startswith(CANARY_KEY_PREFIX):
        return False
    try:
        _, machine, pid, _ = key.rsplit("_", 3)
    except ValueError:
        return False
    return liveness.pid_gone_here(machine.removeprefix("m"), pid)


@dataclass(frozen=True)
class Outcome:
    passed: bool
    text: str  # what a person reads: the table and the two ways on, or a one-line pass
    summary: str  # one line, for status's paused reason


def read_rows(path: Path, ids: list[int], rows: np.ndarray) -> tuple[np.ndarray, dict[str, str]]:
    """A dump's states at ``rows``: float32 [4, R, H] (aux layers, then final), and metadata.

    Raises:
        Corrupt: not the ids sent, or not the layout of contract 2.
        ConfigError: it is a link or another user's file (``dumps.open_file``).
    """
    with open_file(path) as f:
        header = tensorfile.read_header_fd(f.fileno(), path.name)
        t = header.tensors
        n = len(ids)
        if T_HIDDEN not in t or T_AUX not in t or T_INPUT_IDS not in t:
            raise Corrupt(f"{path.name}: canary dump lacks tensors (has {sorted(t)})")
        h = t[T_HIDDEN].shape[-1]
        if (t[T_HIDDEN].dtype, t[T_HIDDEN].shape, t[T_AUX].dtype, t[T_AUX].shape) != (
                "BF16", (n, h), "BF16", (n, AUX_LAYERS * h)):
            raise Corrupt(f"{path.name}: canary dump has shapes {header.shapes}")
        mm = np.memmap(f, dtype=np.uint8, mode="r")  # the mapping outlives the descriptor

    def take(name: str, dtype: str) -> np.ndarray:
        e = t[name]
        return mm[header.data_start + e.begin: header.data_start + e.end].view(dtype).reshape(
            e.shape)

    if not np.array_equal(take(T_INPUT_IDS, "<i8"), np.asarray(ids)):
        raise Corrupt(f"{path.name}: the canary dump's input_ids are not the ids sent")
    hidden = cn.from_bf16(np.array(take(T_HIDDEN, "<u2")[rows]))
    aux = cn.from_bf16(np.array(take(T_AUX, "<u2")[rows])).reshape(len(rows), AUX_LAYERS, h)
    states = np.concatenate([aux.transpose(1, 0, 2), hidden[None]], axis=0)
    return states, header.metadata


async def extract(client: ServerClient, dump_dir: Path, prompts: list[list[int]],
                  rows: list[np.ndarray], timeout_s: float, *, tries: int = PROMPT_TRIES,
                  backoff_s: float = 2.0, backoff_max_s: float = 60.0, run: str = NO_RUN,
                  ) -> list[tuple[np.ndarray, dict[str, str]]]:
    """Send every canary prompt at once (batched, as samples are) and read their dumps, as requests
    of run ``run`` (its janitor leaves them alone); a failed prompt is sent again under a new rid
    with doubling backoff, up to ``tries`` times, and when one fails for good the others are
    cancelled and awaited: nothing of the check outlives it.

    Raises:
        ServerUnavailable: the server is down or its hook inactive (not retried here).
        Transient, Corrupt, NoSpace: a prompt failed ``tries`` times."""
    async def once(i: int) -> tuple[np.ndarray, dict[str, str]]:
        rid = make_rid(canary_key(i), 1, len(prompts[i]), run=run)
        try:
            await client.generate(rid, prompts[i])
            path = await wait_for_dump(dump_dir, rid, timeout_s)
            return read_rows(path, prompts[i], rows[i])
        finally:
            dump_path(dump_dir, rid).unlink(missing_ok=True)
            err_path(dump_dir, rid).unlink(missing_ok=True)

    async def one(i: int) -> tuple[np.ndarray, dict[str, str]]:
        for t in range(1, tries + 1):
            try:
                return await once(i)
            except ServerUnavailable:
                raise  # the caller waits for the server; a retry here would only wait longer
            except (Transient, Corrupt) as e:
                if t >= tries:
                    raise
                delay_s = min(backoff_s * 2 ** (t - 1), backoff_max_s)
                log.info("canary prompt %d: %s: %s; sending it again in %.1fs (try %d of %d)",
                         i, type(e).__name__, e, delay_s, t + 1, tries)
                await asyncio.sleep(delay_s)
        raise AssertionError("unreachable")  # the last try returns or raises

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def server_epoch(dump_dir: Path) -> tuple[tuple[str, int], ...]:
    """The server's ready markers (name and mtime): they change when the server restarts."""
    return markers.epoch(dump_dir)


@dataclass
class CanaryCheck:
    """One worker's canary: records it for the run if nobody has, else compares with it.

    Built in the worker's main process; pool processes inherit its state when they fork, so
    a check passed at start-up is not repeated by each of them at once.
    """

    settings: Settings
    out_dir: Path
    model_path: Path
    fingerprint: Fingerprint
    weights_id: str
    encode: Encode
    run_id: str = NO_RUN  # the run whose requests these are (worker/core/run.py)
    # the most tokens the server takes, where fewer than the run's FARM_MAX_TOKENS (a run that
    # truncates to it): no canary prompt is longer
    server_max_tokens: int | None = None
    last_ok: float = -math.inf
    forced_at: float = 0.0  # wall clock: shared passes older than this are not taken
    epoch: tuple[tuple[str, int], ...] | None = None
    _said: float = field(default=-math.inf, repr=False)
    _said_plain: bool = field(default=False, repr=False)

    def verdicts(self, index: RunIndex,
                 epoch: tuple[tuple[str, int], ...] | None = None) -> Verdicts:
        """The verdict this host's processes share for the server's start ``epoch`` (now's)."""
        if epoch is None:
            epoch = server_epoch(self.settings.dump_dir)
        return Verdicts(index, str(self.settings.dump_dir), epoch)

    def force(self) -> None:
        """Check again before the next sample (the server was seen down).

        A pass that another process of the host recorded before this moment does not count:
        the server may have come back with another model without its ready markers changing
        (the marker of a lazily activated hook is written only at its first request)."""
        self.last_ok = -math.inf
        self.forced_at = time.time()

    def due(self, epoch: tuple[tuple[str, int], ...] | None = None) -> bool:
        """``epoch``: the server's markers when the caller has just read them (one dump-dir
        scan per sample, not two)."""
        if epoch is None:
            epoch = server_epoch(self.settings.dump_dir)
        return (time.monotonic() - self.last_ok >= self.settings.canary_interval_s
                or epoch != self.epoch)

    async def run(self, client: ServerClient) -> Outcome:
        """Record the canary (first worker of the run) or compare with the recording.

        Raises:
            Transient (ServerUnavailable, NoSpace, ...), Corrupt: it could not be run.
            ConfigError: the recording is damaged.
        """
        epoch = server_epoch(self.settings.dump_dir)
        if not cn.path_in(self.out_dir).exists():
            outcome = await self._record(client)
        else:
            outcome = await self._compare(client)
        if outcome.passed:
            self.last_ok, self.epoch = time.monotonic(), epoch
        return outcome

    async def _record(self, client: ServerClient) -> Outcome:
        info = await client.server_info()
        chunk = int(info.get("chunked_prefill_size") or 0)
        longest = min(self.fingerprint.max_tokens, self.server_max_tokens or sys.maxsize)
        prompts = cn.prompt_ids(self.encode, chunk, longest)
        rows = [cn.sample_rows(len(p), chunk) for p in prompts]
        got = await extract(client, self.settings.dump_dir, prompts, rows,
                            self.settings.dump_timeout_s, backoff_s=self.settings.retry_backoff_s,
                            backoff_max_s=self.settings.retry_backoff_max_s, run=self.run_id)
        served = sorted({why for _, meta in got for why in identity_problems(meta,
                                                                            self.fingerprint)})
        if served:  # never record another server's states as the run's
            why = "the canary is not recorded: " + "; ".join(served)
            return Outcome(False, f"waiting, taking no work: {why}", why)
        canaries = [cn.Canary(np.asarray(p, dtype=np.int64), r, s)
                    for p, r, (s, _) in zip(prompts, rows, got, strict=True)]
        meta = cn.recording_meta(self.fingerprint, self.weights_id,
                                 got[0][1].get(M_SERVER_VERSION, ""), chunk)
        if not cn.record(self.out_dir, canaries, meta):
            return await self._compare(client)  # another worker recorded it first
        lengths = ", ".join(str(len(p)) for p in prompts)
        text = (f"recorded the run's canary: {len(prompts)} prompts of {lengths} tokens "
                f"(server chunk size {chunk}) in {cn.path_in(self.out_dir)}")
        return Outcome(True, text, "recorded")

    async def _compare(self, client: ServerClient) -> Outcome:
        recorded, meta = cn.load(self.out_dir)
        if meta.get(cn.M_PROMPTS) != cn.PROMPTS_CHAT and not self._said_plain:
            self._said_plain = True
            log.warning("the run's canary %s was recorded by an older hsfarm from plain text, "
                        "without the chat template's special tokens that every sample starts "
                        "with: it cannot see a change only they read (the BOS token's embedding "
                        "row). It is still compared. To record one that sees it, remove the "
                        "file once the server certainly serves the run's checkpoint (its "
                        "weights identity matches the run's); the next worker records it anew",
                        cn.path_in(self.out_dir))
        prompts = [r.input_ids.tolist() for r in recorded]
        got = await extract(client, self.settings.dump_dir, prompts,
                            [r.rows for r in recorded], self.settings.dump_timeout_s,
                            backoff_s=self.settings.retry_backoff_s,
                            backoff_max_s=self.settings.retry_backoff_max_s, run=self.run_id)
        problems = []
        served = json.loads(got[0][1].get(M_LAYERS, "[]"))
        wanted = json.loads(meta.get(M_LAYERS, "[]"))
        if served != wanted:
            problems.append(f"the server captures layers {served}, the recording layers {wanted}")
        names = json.loads(meta.get(cn.M_LAYERS_NAMES, "[]")) or cn.layer_names(tuple(wanted))
        cmp = cn.compare(recorded, [s for s, _ in got], names, self.settings.canary_max_rel_err,
                         self.settings.canary_mean_rel_err, problems)
        if cmp.passed:
            worst = max((e.max_rel for e in cmp.layers), default=0.0)
            return Outcome(True, f"canary passed: {len(prompts)} prompts, worst max rel err "
                                 f"{worst:.4%} (tolerance {cmp.max_rel_tol:.2%})", "passed")
        return Outcome(False, self._mismatch_text(cmp, meta), "canary mismatch: "
                       + cmp.summary() + ": restore the server's model, or start a new "
                       "FARM_OUTPUT_DIR")

    def _mismatch_text(self, cmp: cn.Comparison, meta: dict[str, str]) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC",
                             time.gmtime(float(meta.get("recorded_at", "0"))))
        rec_weights = meta.get(cn.M_WEIGHTS_ID, "?")
        worst = max((e.max_rel for e in cmp.layers), default=math.inf)
        # Within ten times the tolerance the states are still the same model's, moved by
        # something: a quantisation, or a change of numerics that may be harmless (another TP
        # size, attention backend, GPU type) and larger than the noise measured here on CPU.
        # The files this worker reads matched the run's weights identity at its start.
        numerics = [] if worst >= 10 * cmp.max_rel_tol else [
            "  3. or, if the server still serves that very checkpoint and only its numerics "
            "changed on purpose (TP size, attention backend, kernels, GPU type): an error this "
            "small can be their noise; when it is what you expect, raise "
            "FARM_CANARY_MAX_REL_ERR / FARM_CANARY_MEAN_REL_ERR for every worker "
            "(docs/canary.md has the measured margins)."]
        return "\n".join([
            f"CANARY MISMATCH: the server at {self.settings.server_url} no longer computes the "
            f"hidden states this run recorded in {cn.path_in(self.out_dir)} (recorded {when}, "
            f"weights identity {rec_weights}). Relative error per layer, over the "
            "sampled tokens of every canary prompt:",
            cmp.table(),
            "This worker takes no work: messages stay queued, nothing is marked failed. It "
            f"checks again every {self.settings.pause_poll_s:g}s. "
            + ("Two ways on:" if not numerics else "Three ways on:"),
            "  1. restore the server's model: serve the checkpoint this run started with "
            f"(weights identity {rec_weights}; this worker reads {self.model_path}), and work "
            "resumes by itself;",
            "  2. or keep the new model and start a new output directory for it: set "
            "FARM_OUTPUT_DIR to a new path for the producer and every worker (hidden states "
            "of two models are never mixed in one directory).",
            *numerics,
        ])

    def problem(self, client: ServerClient, loop: asyncio.AbstractEventLoop, index: RunIndex,
                deadline: float = math.inf) -> str | None:
        """For ``waits.until_clear`` in a task: None when not due or passed, else why not; cut short
        at ``deadline`` (monotonic), so a hung server cannot hold the task past its hand-back time.

        A host's processes share their verdict (``worker.state.verdicts``): a pass holds for an
        interval, a mismatch makes every process check before its next sample, and those
        waiting for the lock give the mismatch as their reason.
        """
        epoch = server_epoch(self.settings.dump_dir)
        verdicts = self.verdicts(index, epoch)
        try:
            shared = verdicts.read()
        except Transient as e:
            return f"the canary could not be checked: Redis: {e}"
        if shared.kind != MISMATCH and not self.due(epoch):
            return None
        if shared.kind == OK and shared.at >= self.forced_at:
            self.last_ok, self.epoch = time.monotonic(), epoch
            return None
        # A check is due. A server that does not answer is the reason, in the words of a wait on
        # the server (status names the server as what a stalled run waits on), and no process
        # takes the lock to find that out the slow way while the others wait on it.
        probe_s = max(1.0, min(10.0, self.settings.request_timeout_s,
                               deadline - time.monotonic() - 1.0))
        if not loop.run_until_complete(client.reachable(timeout_s=probe_s)):
            return server_silent(self.settings.server_url)
        try:
            lock = verdicts.try_lock(self.settings.canary_lock_ttl_s)
        except Transient as e:
            return f"the canary could not be checked: Redis: {e}"
        if not isinstance(lock, leases.Lease):
            if shared.kind == MISMATCH:  # what holds the host up, while one process re-checks
                return shared.why or ("canary mismatch (found by another process of this "
                                      "host): restore the server's model, or start a new "
                                      "FARM_OUTPUT_DIR")
            return "the canary is being checked by another process of this host"
        started = time.time()
        limit_s = max(1.0, deadline - time.monotonic() - 1.0)
        try:
            outcome = loop.run_until_complete(asyncio.wait_for(self.run(client), limit_s))
        except TimeoutError:
            return f"the canary could not be checked: no answer within {limit_s:.0f}s"
        except ConfigError:
            raise  # the recording is damaged: the worker stops (tasks.py)
        except Exception as e:  # anything else: wait and check again, never run samples
            return f"the canary could not be checked: {type(e).__name__}: {e}"
        finally:
            lock.release()
        with contextlib.suppress(Transient):
            verdicts.record(outcome.passed, started, outcome.summary,
                            self.settings.canary_interval_s)
        if outcome.passed:
            log.info("%s", outcome.text)
            return None
        if time.monotonic() - self._said > 60:
            self._said = time.monotonic()
            log.error("%s", outcome.text)
        return outcome.summary
