"""``python -m producer dashboard``: one page of plots of the whole run, and ``/metrics``.

An aiohttp app (the farm's HTTP library) with HTTP basic auth on every path, ``/metrics``
included; it listens on loopback by default and serves without a password only when told
(``--no-auth``), and then only on loopback. uPlot draws the plots in the browser
(``producer/dashboard/static/``). Routes: ``/``, ``/static/<file>``, ``/api/run``, ``/metrics``.
Test: tests/farm/test_dashboard.py::test_dashboard_requires_the_password.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hmac
import ipaddress
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from engine_dump.fingerprint import Fingerprint
from producer.dashboard import metrics_text
from producer.dashboard.data import Sampler
from producer.status import no_run, status_fingerprint
from worker.core import outdir
from worker.core import run as runs
from worker.core.errors import ConfigError, Transient
from worker.core.settings import Settings

log = logging.getLogger("hsfarm.dashboard")
STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css",
                "dashboard.js": "text/javascript", "dashboard.css": "text/css"}
REALM = "hsfarm dashboard"
SAMPLER = web.AppKey("sampler", Sampler)
SAMPLE_S = web.AppKey("sample_s", float)
SERVER_TIMEOUT_S = 5.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_auth(args: argparse.Namespace) -> tuple[str, str] | None:
    """(user, password) from ``--basic-auth`` or ``--basic-auth-file``; None with
    ``--no-auth`` on loopback.

    Raises:
        ConfigError: no password and not told to go without, or not on loopback, or a
            malformed USER:PASSWORD.
    """
    if args.basic_auth and args.basic_auth_file:
        raise ConfigError("give --basic-auth or --basic-auth-file, not both")
    text = args.basic_auth
    if args.basic_auth_file is not None:
        try:
            text = args.basic_auth_file.read_text().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise ConfigError(f"--basic-auth-file {args.basic_auth_file}: cannot read a "
                              f"USER:PASSWORD line ({e})") from e
    if text is None:
        if not args.no_auth:
            raise ConfigError("the dashboard needs a password: --basic-auth USER:PASSWORD or "
                              "--basic-auth-file FILE (or --no-auth, on loopback only)")
        if not is_loopback(args.address):
            raise ConfigError(f"--no-auth is refused on {args.address}: anyone who can reach "
                              "it would see the run; bind 127.0.0.1 (the default) or set a "
                              "password")
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ConfigError("basic auth must be USER:PASSWORD with neither part empty")
    return user, password


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def auth_middleware(user: str, password: str) -> Any:
    expected = base64.b64encode(f"{user}:{password}".encode()).decode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        try:
            ok = scheme.lower() == "basic" and hmac.compare_digest(
                base64.b64encode(base64.b64decode(given, validate=True)).decode(), expected)
        except (binascii.Error, ValueError):
            ok = False
        if not ok:
            return web.Response(status=401, text="authentication required\n",
                                headers={"WWW-Authenticate": f'Basic realm="{REALM}"'})
        return await handler(request)

    return check


async def page(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "dashboard.html",
                            headers={"Content-Type": "text/html; charset=utf-8"})


async def static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in STATIC_FILES:  # a fixed list: no path from the request reaches the disk
        raise web.HTTPNotFound()
    return web.FileResponse(STATIC / name, headers={"Content-Type": STATIC_FILES[name]})


async def api_run(request: web.Request) -> web.StreamResponse:
    sampler = request.app[SAMPLER]
    if not sampler.snapshot:
        return web.json_response({"error": sampler.error or "first sample not taken yet"},
                                 status=503)
    return web.json_response({**sampler.snapshot, "error": sampler.error,
                              "sample_s": request.app[SAMPLE_S]})


async def metrics(request: web.Request) -> web.StreamResponse:
    sampler = request.app[SAMPLER]
    if not sampler.snapshot:
        raise web.HTTPServiceUnavailable(text=f"{sampler.error or 'no sample yet'}\n")
    return web.Response(body=metrics_text.render(sampler.snapshot).encode(),
                        headers={"Content-Type": metrics_text.CONTENT_TYPE})


async def server_health(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """Whether the inference server answers ``/health`` now, and how fast."""
    t0 = time.monotonic()
    try:
        async with session.get(f"{url.rstrip('/')}/health",
                               timeout=aiohttp.ClientTimeout(total=SERVER_TIMEOUT_S)) as resp:
            up = resp.status == 200
            detail = "ok" if up else f"HTTP {resp.status}"
    except (aiohttp.ClientError, TimeoutError) as e:
        up, detail = False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return {"url": url, "up": up, "detail": detail,
            "latency_s": round(time.monotonic() - t0, 4) if up else None}


async def sample_forever(app: web.Application) -> None:
    sampler, period_s = app[SAMPLER], app[SAMPLE_S]
    async with aiohttp.ClientSession() as session:
        while True:
            server = await server_health(session, sampler.settings.server_url)
            try:
                await asyncio.to_thread(sampler.sample, server)
            except Transient as e:
                sampler.redis_away(e)
                log.warning("%s", sampler.error)
            await asyncio.sleep(period_s)


async def _sampling(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(sample_forever(app))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def make_app(settings: Settings, fingerprint: Fingerprint, auth: tuple[str, str] | None,
             sample_s: float = 10.0) -> web.Application:
    app = web.Application(middlewares=[auth_middleware(*auth)] if auth else [])
    app[SAMPLER] = Sampler(settings, fingerprint)
    app[SAMPLE_S] = sample_s
    app.router.add_get("/", page)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/run", api_run)
    app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(_sampling)
    return app


def main_dashboard(settings: Settings, args: argparse.Namespace) -> int:
    """Serve until interrupted. Exit 2 when it cannot start (auth, address, the run)."""
    auth = read_auth(args)
    if args.sample_s <= 0:
        raise ConfigError(f"--sample-s must be > 0, not {args.sample_s}")
    if not (Path(settings.output_dir) / outdir.MANIFEST).is_file():
        print(f"note: {no_run(settings)}; the dashboard shows the run once it begins",
              file=sys.stderr, flush=True)
    fingerprint, source = status_fingerprint(settings)
    app = make_app(settings, fingerprint, auth, args.sample_s)
    try:
        sock = socket.create_server((args.address, args.port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.address}:{args.port} ({e.strerror}); is "
                          "another dashboard running? pick another --port") from e
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    who = f"basic auth as {auth[0]}" if auth else "NO password (loopback only)"
    print(f"dashboard of run {runs.run_id_of(settings.output_dir)} (from {source}) on "
          f"http://{args.address}:{args.port}/ ({who}); metrics at /metrics", flush=True)
    web.run_app(app, sock=sock, print=None, handle_signals=True)
    return 0
