"""Helpers shared by the fault tests: farms with real processes, and ways to break them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from producer.dashboard import metrics_text
from producer.dashboard.data import Sampler
from producer.localfarm.farm import LocalFarm, free_port, wait_until
from producer.status import status_fingerprint
from tests.conftest import served_farm, write_samples
from worker.core.settings import Settings
from worker.state import keys


def text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    """``records`` as a JSONL data file at ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def count_line(out: str, what: str) -> int:
    """The number on the CLI output line ``<what>: N``."""
    m = re.search(rf"^{what}: (\d+)", out, re.M)
    assert m, out
    return int(m.group(1))


def dashboard_metrics(settings: Settings) -> tuple[dict[str, Any], str]:
    """One sample of the run as the dashboard takes it, and its ``/metrics`` text."""
    fp, _ = status_fingerprint(settings)  # from the run's manifest, as the dashboard's
    snapshot = Sampler(settings, fp).sample({"up": True})
    return snapshot, metrics_text.render(snapshot)


@contextmanager
def running_farm(tmp_path: Path, server_args: list[str] | None = None,
                 env: dict[str, str] | None = None, chunk: int = 64,
                 start_redis: bool = True) -> Iterator[LocalFarm]:
    with served_farm(tmp_path / "farm", chunk, env=env, server_args=server_args,
                     redis=start_redis) as farm:
        yield farm


def enqueue(farm: LocalFarm, tmp_path: Path, n: int, start: int = 0,
            max_chars: int | None = None) -> list[str]:
    """Enqueue ``n`` example samples from ``start`` (``max_chars``: see ``write_samples``),
    each start in a data file of its own."""
    data = tmp_path / ("data.json" if start == 0 else f"data-{start}.json")
    samples = write_samples(data, n, start, max_chars)
    res = farm.cli("enqueue", str(data), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    return [str(s["id"]) for s in samples]


def send_task(farm: LocalFarm, body: object, task_id: str) -> None:
    """Publish one task message with this body, as any client of the broker could."""
    code = ("import json, sys; from worker.app import app; from worker.core.run import TASK_NAME; "
            "app.send_task(TASK_NAME, args=[json.loads(sys.stdin.read())], task_id=sys.argv[1], "
            "queue=sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, task_id, farm.queue()], input=json.dumps(body),
                   text=True,
                   env=farm.env(), check=True, timeout=60)


def run_hash(farm: LocalFarm, name: str) -> dict[str, str]:
    """One of the run index's hashes (all runs merged; tests have one)."""
    r = farm.redis()
    out: dict[str, str] = {}
    for k in r.scan_iter(f"{keys.PREFIX}:*:{name}"):
        out.update({text(a): text(b) for a, b in r.hgetall(k).items()})
    return out


def attempts(farm: LocalFarm) -> dict[str, int]:
    return {k: int(v) for k, v in run_hash(farm, keys.ATTEMPTS).items()}


def failed(farm: LocalFarm) -> dict[str, str]:
    return {k: json.loads(v)["reason"] for k, v in run_hash(farm, keys.FAILED).items()}


def running_pids(farm: LocalFarm) -> dict[int, str]:
    """pid → sample key of the tasks running now."""
    return {int(json.loads(v)["worker"].rsplit(":", 1)[1]): k
            for k, v in run_hash(farm, keys.RUNNING).items()}


def settled(value: Callable[[], int], quiet_s: float, timeout_s: float) -> int:
    """``value()`` once it has not changed for ``quiet_s`` seconds (e.g. the samples done, once
    the requests already sent have ended)."""
    last, since = value(), time.monotonic()

    def quiet() -> bool:
        nonlocal last, since
        now = value()
        if now != last:
            last, since = now, time.monotonic()
        return time.monotonic() - since >= quiet_s

    wait_until(quiet, timeout_s, f"a value that stays put for {quiet_s:g} s", poll_s=0.5)
    return last


def busy_child(farm: LocalFarm, worker: str, timeout_s: float = 60) -> tuple[int, str]:
    """A pool process of ``worker`` that is in the middle of a task, and its sample."""
    found: dict[int, str] = {}

    def busy() -> bool:
        children = set(farm.procs[worker].children())
        found.clear()
        found.update({p: k for p, k in running_pids(farm).items() if p in children})
        return bool(found)

    wait_until(busy, timeout_s, f"a busy pool process in {worker}", poll_s=0.02)
    return next(iter(found.items()))


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


@contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real size-limited tmpfs (root only): writes past it fail with ENOSPC."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def can_mount_tmpfs(tmp_path: Path) -> bool:
    probe = tmp_path / "probe-mount"
    try:
        with small_tmpfs(probe, "1M"):
            return True
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError):
        return False


class FlakyProxy:
    """An HTTP proxy in front of the server, run on a thread of the test process, that fails
    ``/generate`` requests in a fixed pattern while ``flaky``: of every four, the second is
    answered 500 without reaching the server, and the fourth reaches it under a rid the hook
    does not dump (the server answers 200; no dump ever appears). Everything else passes.

    Any three requests sent at once include a failing one.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flaky = True
        self.generates = 0
        self.failed = {"500": 0, "no dump": 0}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flaky-proxy",
                                        daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def __enter__(self) -> FlakyProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
        app = web.Application(client_max_size=1 << 28)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/generate" and self.flaky:
            n, self.generates = self.generates, self.generates + 1
            if n % 4 == 1:
                self.failed["500"] += 1
                return web.json_response({"error": {"message": "injected server error"}},
                                         status=500)
            if n % 4 == 3:
                self.failed["no dump"] += 1
                req = json.loads(body)
                req["rid"] = f"withheld-{req.get('rid')}"
                body = json.dumps(req).encode()
        assert self._session is not None
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=body, headers={"Content-Type": "application/json"}
                                         ) as resp:
            data = await resp.read()
            return web.Response(body=data, status=resp.status,
                                content_type=resp.content_type)


RESET = 0  # Gateway.answer's status for "reset the connection"


class Gateway:
    """A small real HTTP proxy in front of the server (a rate limiter, a load balancer):
    it forwards every request, or answers them all itself while ``refuse`` is in force."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.answer: tuple[int, str, str] | None = None  # status, content type, body
        self.only: str | None = None  # the path refused; None: every path
        self.refused = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the gateway did not start")

    def refuse(self, status: int, body: str, content_type: str = "text/html") -> None:
        self.answer, self.only = (status, content_type, body), None

    def reset(self, only: str | None = None) -> None:
        """Reset connections instead of answering (a load balancer dropping them), of every
        request or of those for the path ``only``."""
        self.answer, self.only = (RESET, "", ""), only

    def forward(self) -> None:
        self.answer, self.only = None, None

    def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout

        async def handle(request: web.Request) -> web.StreamResponse:
            if self.only is not None and request.path != self.only:
                pass  # forwarded
            elif self.answer is not None and self.answer[0] == RESET:
                self.refused += 1
                assert request.transport is not None
                request.transport.abort()  # the connection reset, no answer
                return web.Response()
            elif self.answer is not None:
                self.refused += 1
                status, kind, body = self.answer
                return web.Response(status=status, text=body, content_type=kind)
            async with ClientSession(timeout=ClientTimeout(total=120)) as s, s.request(
                    request.method, self.upstream + request.path_qs,
                    data=await request.read(),
                    headers={"Content-Type": request.content_type}) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type=resp.content_type)

        async def main() -> None:
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(main())
        self._loop.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


NGINX_429 = ("<html>\r\n<head><title>429 Too Many Requests</title></head>\r\n<body>\r\n"
             "<center><h1>429 Too Many Requests</h1></center>\r\n<hr><center>nginx</center>\r\n"
             "</body>\r\n</html>\r\n")
NGINX_413 = ("<html>\r\n<head><title>413 Request Entity Too Large</title></head>\r\n<body>\r\n"
             "<center><h1>413 Request Entity Too Large</h1></center>\r\n<hr><center>nginx"
             "</center>\r\n</body>\r\n</html>\r\n")
NGINX_502 = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
             "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
             "</body>\r\n</html>\r\n")


@contextmanager
def read_only(path: Path, timeout_s: float = 30) -> Iterator[None]:
    """Remount the tmpfs at ``path`` read-only (as ext4's errors=remount-ro does), then back.

    A remount to read-only fails with EBUSY while a file is open for writing: retried."""
    import time

    t0 = time.monotonic()
    while True:
        res = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True)
        if res.returncode == 0:
            break
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"cannot remount {path} read-only: {res.stderr!r}")
        time.sleep(0.01)
    try:
        yield
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(path)], check=True)
