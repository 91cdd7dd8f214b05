"""What a worker holds: the run's context, built once, and each process's own connections.

``RunContext`` (model path, tokenizer, fingerprint, output store) is built in the worker's
main process before it consumes anything, and pool processes inherit it when they fork: a
pool process never has to ask the server or read the model's files, so it cannot fail at a
point where it already holds a message. ``Runtime`` adds what must not cross a fork: one
event loop and one HTTP session (Celery has no asyncio pool; prefork is the pool that
requeues a task whose process died) and one Redis connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from engine_dump import dumpdir
from engine_dump.dumpfile import M_WRITER, PATCH_VERSION
from engine_dump.fingerprint import Fingerprint
from worker.core.errors import ConfigError
from worker.core.run import queue_for as run_queue
from worker.core.settings import GenSettings, Settings
from worker.core.store import OutputStore
from worker.server.admission import (
    GEN_SLOT_DIR,
    Admission,
    Limits,
    generation_limits,
    limits_for_host,
)
from worker.server.canary_check import CanaryCheck, chat_encoder
from worker.server.chat import ChatTokenizer
from worker.server.client import ServerClient
from worker.server.fingerprint import load_run
from worker.server.limits import server_info, server_max_tokens
from worker.server.sample_proof import Prover
from worker.state import broker
from worker.state.hosts import host_id
from worker.state.index import RunIndex

log = logging.getLogger("hsfarm.worker")


@dataclass(frozen=True)
class RunContext:
    settings: Settings
    model_path: Path
    chat: ChatTokenizer
    fingerprint: Fingerprint
    store: OutputStore
    limits: Limits  # the host's admission limits (in flight, dump budget)
    canary: CanaryCheck  # its state (last passed) is inherited by pool processes
    prover: Prover | None = None  # the LM head, mapped once: pool processes share its pages
    # what the hook probe's dump said (``engine_dump.probe``); its ``M_WRITER`` names the
    # server start whose ready marker is read where a dump dir is shared
    probe_meta: dict[str, str] = field(default_factory=dict)
    generation: GenSettings | None = None  # a regenerating run's settings (FARM_REGENERATE)
    gen_limits: Limits | None = None  # and its places for generations

    @property
    def writer(self) -> str | None:
        return self.probe_meta.get(M_WRITER)

    @classmethod
    def build(cls, settings: Settings, server_wait_s: float = 0.0,
              probe: Callable[[], dict[str, str]] | None = None) -> RunContext:
        """Raises ConfigError (unreachable server, foreign output dir, bad tokenizer, a server
        context shorter than FARM_MAX_TOKENS with FARM_OVERLONG=reject).

        Args:
            probe: the hook probe, run once the output dir is open (its weights checked: no
                request before), its dump's metadata returned; None: no probe."""
        check_dump_dir(settings)
        model_path, chat, fp = load_run(settings, wait_s=server_wait_s)
        # before the manifest is written: a server that takes fewer tokens than the run allows
        info = server_info(settings, wait_s=server_wait_s)
        chat.server_max_tokens = server_max_tokens(settings, info)
        store = OutputStore(settings.output_dir, fp,
                            versions={"hsfarm": PATCH_VERSION, "model_path": str(model_path)},
                            debug_write_delay_s=settings.debug_write_delay_s,
                            model_path=model_path).open()
        probe_meta = probe() if probe is not None else {}
        limits = limits_for_host(settings, fp.hidden_size, writer=probe_meta.get(M_WRITER))
        log.info("admission: %s", limits.describe())
        check = CanaryCheck(settings, settings.output_dir, model_path, fp, store.weights_id,
                            encode=chat_encoder(chat), run_id=store.run_id,
                            server_max_tokens=chat.server_max_tokens)
        prover = Prover.for_run(settings, model_path, fp.hidden_size)
        gen = GenSettings.of(settings)
        gen_limits = None
        if gen is not None:
            gen_limits = generation_limits(settings, info)
            log.info("regenerating: %s; %s", gen.identity(), gen_limits.describe())
        return cls(settings, model_path, chat, fp, store, limits, check, prover, probe_meta,
                   gen, gen_limits)


def check_dump_dir(settings: Settings) -> None:
    """Raises ConfigError when the dump dir is not the server's and the workers' alone.

    Checked first: a server that refuses it never comes up, and every check that waits for
    the server would wait forever."""
    try:
        dumpdir.ensure(settings.dump_dir)
    except dumpdir.DumpDirUnsafe as e:
        raise ConfigError(str(e)) from e


@dataclass
class Runtime:
    settings: Settings
    loop: asyncio.AbstractEventLoop
    client: ServerClient
    chat: ChatTokenizer
    fingerprint: Fingerprint
    store: OutputStore
    index: RunIndex
    hostname: str
    admission: Admission
    canary: CanaryCheck
    prover: Prover | None = None
    generation: GenSettings | None = None
    gen_admission: Admission | None = None

    @property
    def run_id(self) -> str:
        """The run this worker serves (worker/core/run.py): its keys, queue, rids and dumps."""
        return self.store.run_id

    @property
    def queue(self) -> str:
        return run_queue(self.settings, self.store.run_id)

    @classmethod
    def for_process(cls, ctx: RunContext) -> Runtime:
        """This process's loop, HTTP client and Redis connection over the shared context."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        s = ctx.settings
        return cls(settings=s, loop=loop, client=ServerClient.of(s, writer=ctx.writer),
                   chat=ctx.chat, fingerprint=ctx.fingerprint, store=ctx.store,
                   index=RunIndex(broker.client(s), ctx.store.run_id),
                   hostname=host_id(s),
                   admission=Admission(s.dump_dir, ctx.limits, wait_s=s.task_time_limit_s / 2,
                                       dp_routing=s.dp_routing),
                   canary=ctx.canary, prover=ctx.prover, generation=ctx.generation,
                   gen_admission=None if ctx.gen_limits is None else Admission(
                       s.dump_dir, ctx.gen_limits, wait_s=s.task_time_limit_s / 2,
                       dp_routing=s.dp_routing, slot_dir=GEN_SLOT_DIR))

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.client.close())
        finally:
            self.loop.close()
