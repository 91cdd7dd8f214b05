"""Everything a worker process holds for its life: built once, after the pool forks.

One event loop and one aiohttp session per process (Celery has no asyncio pool; prefork is
the pool that requeues a task whose process died). The tokenizer, fingerprint, output store
and Redis index live here too.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import redis

from sglang_patch import contracts as c
from worker.admission import Admission, host_limits
from worker.chat import ChatTokenizer
from worker.client import ServerClient
from worker.fingerprint import load_run
from worker.index import RunIndex
from worker.settings import Settings
from worker.store import OutputStore

log = logging.getLogger("hsfarm.worker")


@dataclass
class Runtime:
    settings: Settings
    loop: asyncio.AbstractEventLoop
    client: ServerClient
    chat: ChatTokenizer
    fingerprint: c.Fingerprint
    store: OutputStore
    index: RunIndex
    hostname: str
    admission: Admission

    @classmethod
    def build(cls, settings: Settings, server_wait_s: float = 0.0) -> Runtime:
        """Raises ConfigError (unreachable server, foreign output dir, bad tokenizer)."""
        model_path, chat, fp = load_run(settings, wait_s=server_wait_s)
        store = OutputStore(settings.output_dir, fp, settings.min_free_output_bytes,
                            versions={"hsfarm": c.PATCH_VERSION, "model_path": str(model_path)},
                            debug_write_delay_s=settings.debug_write_delay_s).open()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        r = redis.Redis.from_url(settings.redis_url, socket_timeout=30,
                                 socket_connect_timeout=5, health_check_interval=30)
        client = ServerClient(settings.server_url, settings.request_timeout_s)
        settings.dump_dir.mkdir(parents=True, exist_ok=True)
        limits = loop.run_until_complete(host_limits(settings, fp.hidden_size, client))
        log.info("admission: %s", limits.describe())
        rt = cls(settings=settings, loop=loop, client=client, chat=chat, fingerprint=fp,
                 store=store, index=RunIndex(r, fp.id), hostname=socket.gethostname(),
                 admission=Admission(settings.dump_dir, limits,
                                     wait_s=settings.task_time_limit_s / 2))
        return rt

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.client.close())
        finally:
            self.loop.close()

