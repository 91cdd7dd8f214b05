"""A worker's start: every check that can fail runs before it consumes (``worker_init``).

Order: Redis auth and persistence, the run context (waiting for the server; its longest input
against ``FARM_MAX_TOKENS``; the manifest; the hook probe, whose dump names the server start
whose ready marker the worker reads), dead writers' temp files, the served weights, layers,
config and dtype (``served_identity``), the canary (recorded, or compared: waits while it
differs). A ConfigError exits 2 with the fix; pool processes inherit ``app.context`` at fork.
Test: tests/farm/test_startup.py::test_misconfigured_worker_stops_before_taking_anything."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from typing import Any

import redis
from celery import current_app
from celery.signals import worker_init, worker_process_init, worker_process_shutdown

from engine_dump.dumpdir import DumpDirUnsafe
from engine_dump.probe import ProbeFailed, probe
from worker.app import FarmApp
from worker.core import canary, liveness, outdir, run, time_limits
from worker.core.errors import ConfigError, Transient
from worker.core.settings import Settings
from worker.runtime import RunContext, Runtime
from worker.server import served_identity
from worker.server.canary_check import Outcome
from worker.server.client import ServerClient
from worker.state import broker, owners, queue_scan
from worker.state.index import RunIndex
from worker.steps.host_beat import register_host

log = logging.getLogger("hsfarm.worker")

MAIN_PID = 0
_runtime: Runtime | None = None  # this process's own: never shared across a fork


def runtime(app: FarmApp) -> Runtime:
    """This process's runtime over ``app.context`` (a pool process builds its own after the
    fork)."""
    global _runtime
    if _runtime is None:
        if app.context is None:  # a pool that does not fork from a started main process
            app.context = RunContext.build(app.settings, server_wait_s=math.inf)
        _runtime = Runtime.for_process(app.context)
    return _runtime


def stop_worker(reason: str) -> None:
    """Stop the whole worker (warm shutdown): it cannot work until a person fixes ``reason``."""
    log.critical("stopping this worker: %s", reason)
    os.kill(MAIN_PID or os.getpid(), signal.SIGTERM)


def _wait_for_redis(settings: Settings) -> redis.Redis:
    """Until Redis answers a ping. A worker that has never reached it waits at most
    ``redis_start_wait_s``: a mistyped ``REDIS_URL`` or a refused password never heals by
    itself, and a worker waiting forever looks healthy to systemd. Once connected, an outage
    pauses the work instead (``steps/outage.py``).

    Raises:
        ConfigError: the URL is an open door, Redis refuses our credentials, or it did not
            answer within ``redis_start_wait_s``: each with the URL (password masked) and the fix.
    """
    allowed = broker.check_auth(settings)  # an open door stops the worker here (exit 2)
    if allowed:
        log.warning("%s", allowed)
    r = broker.client(settings)
    said = -math.inf
    deadline = time.monotonic() + settings.redis_start_wait_s
    while True:
        try:
            r.ping()
            return r
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as e:
            raise ConfigError(_redis_refused(settings, e)) from e
        except redis.RedisError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(_redis_unreachable(settings, e)) from e
            if time.monotonic() - said > 30:
                said = time.monotonic()
                log.warning("waiting for Redis at %s (at most %.0f s more): %s",
                            broker.where(settings), deadline - time.monotonic(), e)
            time.sleep(1.0)


def _redis_refused(settings: Settings, e: Exception) -> str:
    return (f"Redis at {broker.where(settings)} refuses this worker's credentials ({e}): fix "
            "the user or password in REDIS_URL (/etc/hsfarm/env; python -m producer settings "
            "shows what the worker reads)")


def _redis_unreachable(settings: Settings, e: Exception) -> str:
    return (f"Redis at {broker.where(settings)} did not answer within "
            f"{settings.redis_start_wait_s:.0f} s of this worker's start ({e}): check REDIS_URL "
            "(host, port, database; python -m producer settings shows what the worker reads) "
            "and that Redis runs there (systemctl status hsfarm-redis, or ops/start-redis.sh); "
            "FARM_REDIS_START_WAIT_S waits longer for a Redis that starts after the workers")


def _wait_for_hook(settings: Settings) -> dict[str, str]:
    """Until a probe request of ours comes back as a dump in this worker's dump dir; the dump's
    metadata (what the server says about the weights, layers and config it serves)."""
    said = -math.inf
    while True:
        try:
            result = probe(settings.server_url, settings.dump_dir,
                           timeout_s=min(60.0, settings.dump_timeout_s))
            log.info("probe: %s", result.summary)
            return result.metadata
        except DumpDirUnsafe as e:
            raise ConfigError(str(e)) from e
        except ProbeFailed as e:
            if time.monotonic() - said > 30:
                said = time.monotonic()
                log.warning("waiting, taking no work, for the server and its dump hook to "
                            "answer a probe request: %s", e)
            time.sleep(2.0)


def _wait_for_canary(ctx: RunContext, r: redis.Redis) -> None:
    """Until the canary is recorded for this run, or the server's states match the recording."""
    settings = ctx.settings
    check, index = ctx.canary, RunIndex(r, ctx.store.run_id)
    said = -math.inf

    async def once() -> Outcome:
        client = ServerClient.of(settings)
        try:
            return await check.run(client)
        finally:
            await client.close()

    while True:
        try:
            outcome = asyncio.run(once())
        except ConfigError:
            raise
        except Exception as e:  # a 4xx, an unreadable recording...: wait, never consume
            why = f"the canary could not be checked: {type(e).__name__}: {e}"
            outcome = Outcome(False, f"waiting, taking no work: {why}", why)
        if outcome.passed:
            log.info("%s", outcome.text)
            with contextlib.suppress(Transient):
                index.set_paused(liveness.identity(), None)
            return
        if time.monotonic() - said > 60:
            said = time.monotonic()
            log.error("%s", outcome.text)
        with contextlib.suppress(Transient):
            index.set_paused(liveness.identity(), outcome.summary)
        time.sleep(settings.pause_poll_s)


def _check_served(ctx: RunContext, probe_meta: dict[str, str]) -> None:
    """Raises ConfigError when the server serves other weights than the run's or than
    FARM_MODEL_PATH's, other layers, config or dtype (``served_identity``), with the fix."""
    settings, store = ctx.settings, ctx.store
    served_identity.check(
        settings, ctx.fingerprint, probe_meta, recorded=store.weights_recorded,
        local=store.weights_local, model_path=ctx.model_path,
        manifest=settings.output_dir / outdir.MANIFEST,
        started=canary.path_in(settings.output_dir).exists())


@worker_init.connect
def _on_worker_init(sender: Any, **_: Any) -> None:
    global MAIN_PID
    app: FarmApp = sender.app
    settings = app.settings
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    MAIN_PID = os.getpid()
    try:
        r = _wait_for_redis(settings)
        broker.check_persistence(r, settings)
        # the probe's dump names the server start whose ready marker is ours
        ctx = app.context = RunContext.build(settings, server_wait_s=math.inf,
                                             probe=lambda: _wait_for_hook(settings))
        per_token = ctx.limits.bytes_per_token
        time_limits.check_visibility(settings, per_token)
        longest = time_limits.for_tokens(settings, settings.max_tokens, per_token)
        ctx.store.clean_stale_temp(max_age_s=longest.hard_s * 2)
        _consume_the_runs_queue(app, r, ctx.store.run_id)
        register_host(r, settings, ctx.store.run_id, ctx.fingerprint.id)
        _check_served(ctx, ctx.probe_meta)
        _wait_for_canary(ctx, r)
        owners.beat(r, settings)  # alive before the first message is ours
    except ConfigError as e:
        log.critical("cannot start: %s", e)
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from e  # BaseException: Celery's signal dispatch lets it through
    except Exception as e:
        # Celery's signal dispatch would log any other exception and let the worker consume
        # with its checks half done; stop instead (systemd restarts it: exit code 1)
        log.critical("cannot start: unexpected %s: %s", type(e).__name__, e, exc_info=True)
        raise SystemExit(1) from e
    log.info("run %s: model %s, output %s, queue %s", ctx.store.run_id,
             ctx.model_path, settings.output_dir, run.queue_for(settings, ctx.store.run_id))


def _consume_the_runs_queue(app: FarmApp, r: redis.Redis, run_id: str) -> None:
    """Consume the run's own queue and no other (``-Q`` included): the consumer is built
    after ``worker_init``, from the queues selected here."""
    queue = run.queue_for(app.settings, run_id)
    app.amqp.queues.select([queue])
    app.conf.task_default_queue = queue
    others = queue_scan.note_queue(r, queue, run_id)
    if others:
        log.warning("%s", queue_scan.sharing_warning(queue, run_id, others))


@worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    global _runtime
    _runtime = None  # never share a loop/session/socket across fork
    runtime(current_app)  # the pool process's app: the worker's, made current by Celery


@worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    if _runtime is not None:
        _runtime.close()
