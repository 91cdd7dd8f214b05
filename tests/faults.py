"""Helpers shared by the fault tests: farms with real processes, and ways to break them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import aiohttp
from aiohttp import web

from producer.localfarm import LocalFarm, free_port, wait_until
from tests.conftest import CACHE, FAST_ENV, write_samples
from worker import keys


def text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


@contextmanager
def running_farm(tmp_path: Path, server_args: list[str] | None = None,
                 env: dict[str, str] | None = None, chunk: int = 64,
                 start_redis: bool = True) -> Iterator[LocalFarm]:
    farm = LocalFarm(tmp_path / "farm", cache_dir=CACHE, chunked_prefill_size=chunk,
                     extra_env={**FAST_ENV, **(env or {})})
    try:
        if start_redis:
            farm.start_redis()
        farm.start_server(server_args)
        yield farm
    finally:
        farm.close(kill=True)


def enqueue(farm: LocalFarm, tmp_path: Path, n: int, start: int = 0) -> list[str]:
    """Enqueue ``n`` example samples from ``start``, each start in a data file of its own."""
    data = tmp_path / ("data.json" if start == 0 else f"data-{start}.json")
    samples = write_samples(data, n, start)
    res = farm.cli("enqueue", str(data), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    return [str(s["id"]) for s in samples]


def send_task(farm: LocalFarm, body: object, task_id: str) -> None:
    """Publish one task message with this body, as any client of the broker could."""
    code = ("import json, sys; from worker.app import TASK_NAME, app; "
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
