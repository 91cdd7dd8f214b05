"""A whole farm on one machine, as real processes: Redis, the reference server, Celery workers.

Used by ``python -m producer demo`` and by the test suite (which kills these processes with
real signals). Every process is started in its own session so that stopping it stops its
children too, and ``LocalFarm.close`` leaves nothing running.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from worker.core.run import queue_for, run_id_of
from worker.core.settings import Settings
from worker.state import broker
from worker.state.broker import Client
from worker.state.index import every_runs_outcomes

NOTORCH = str(Path(__file__).resolve().parent / "notorch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str,
               poll_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _answers(proc: Proc, port: int, path: str) -> bool:
    """The process is up and answers HTTP on ``port`` (any status: 401 counts)."""
    if not proc.alive():
        raise RuntimeError(f"{proc.name} exited; see {proc.log}")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
            return s.recv(12).startswith(b"HTTP/1.")
    except OSError:
        return False


class Child(Protocol):
    """A started process: ``subprocess.Popen``, or what a ``launcher`` gives."""

    pid: int
    returncode: int | Any

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# How a process is started when not by a plain Popen: ``launcher(argv, env, log)`` returns the
# started child, in its own session, its output appended to ``log``, or None for a command it
# does not start. The test suite sets one that forks reference servers from a process that has
# imported torch and transformers once (tests/support/forkserver.py); the demo sets none.
Launcher = Callable[[list[str], dict[str, str], Path], Child | None]
launcher: Launcher | None = None


@dataclass
class Proc:
    """A started subprocess with its log file."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    popen: Child | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.popen = launcher(self.argv, self.env, self.log) if launcher else None
        if self.popen is None:
            with open(self.log, "ab") as out:
                self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                              env=self.env, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal this process only (not its children)."""
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, then SIGKILL it if it does not go."""
        if self.popen is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            with suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            try:
                self.popen.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with suppress(ProcessLookupError):  # stragglers of the group (orphaned children)
            os.killpg(self.pid, signal.SIGKILL)

    def kill_group(self) -> None:
        """SIGKILL the process and its children, and reap it."""
        if self.popen is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def children(self) -> list[int]:
        """Direct children's pids (e.g. Celery's pool processes)."""
        path = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        try:
            return [int(x) for x in path.read_text().split()]
        except OSError:
            return []


@dataclass
class LocalFarm:
    """Starts and tracks the processes of one local farm under ``work_dir``."""

    work_dir: Path
    model: str = "tiny"
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "hsfarm")
    chunked_prefill_size: int = 512
    redis_url: str | None = None  # an existing Redis; None starts a private one
    # Workers and CLI calls run without torch, as on a worker host: this venv has it for the
    # reference server, and transformers imports it whenever it can (~220 MB, ~2 s a start)
    workers_without_torch: bool = True
    dumps: Path | None = None  # the dump dir, when not work_dir/dumps (a server of its own)
    extra_env: dict[str, str] = field(default_factory=dict)
    redis_port: int = 0
    server_port: int = 0
    procs: dict[str, Proc] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.server_port = self.server_port or free_port()

    @property
    def dump_dir(self) -> Path:
        return self.dumps or self.work_dir / "dumps"

    @property
    def output_dir(self) -> Path:
        return self.work_dir / "out"

    def env(self) -> dict[str, str]:
        """The environment every farm process and CLI call gets."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("FARM_") and k != "REDIS_URL"}
        env.update({
            "REDIS_URL": self.redis_url or f"redis://127.0.0.1:{self.redis_port}/0",
            "FARM_SERVER_URL": f"http://127.0.0.1:{self.server_port}",
            "FARM_DUMP_DIR": str(self.dump_dir),
            "FARM_OUTPUT_DIR": str(self.output_dir),
            "FARM_MIN_FREE_OUTPUT_BYTES": "0",
            "FARM_MIN_FREE_DUMP_BYTES": "0",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        })
        env.update(self.extra_env)
        return env

    def settings(self) -> Settings:
        return Settings.from_env(self.env())

    def run_id(self) -> str:
        """The run of this farm's output dir (``NO_RUN`` before its manifest is written)."""
        return run_id_of(self.output_dir)

    def queue(self) -> str:
        """The queue of this farm's run."""
        return queue_for(self.settings(), self.run_id())

    def redis(self) -> Client:
        return broker.client(self.settings())

    def outcomes(self) -> tuple[int, int]:
        """(samples done, samples failed or rejected), over every run in this farm's Redis."""
        return every_runs_outcomes(self.redis())

    def start_redis(self, appendonly: bool = True, extra_args: list[str] | None = None) -> Proc:
        """A private redis-server with AOF (``appendfsync always``), as ops/redis.conf sets
        it for the broker; ``appendonly=False``: one that keeps nothing (tests of refusal);
        ``extra_args``: more of redis-server's options (ACL users, TLS), set ``redis_url``."""
        if not self.redis_port:
            self.redis_port = free_port()
        data = self.work_dir / "redis"
        data.mkdir(exist_ok=True)
        argv = [shutil.which("redis-server") or "redis-server", "--port", str(self.redis_port),
                "--bind", "127.0.0.1", "--dir", str(data), "--save", "",
                "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
                "--maxmemory-policy", "noeviction", "--daemonize", "no", *(extra_args or [])]
        proc = self._start("redis", argv)
        wait_until(self._redis_up, 20, "redis-server")
        return proc

    def _redis_up(self) -> bool:
        return broker.answers(self.settings())

    def start_server(self, extra: list[str] | None = None) -> Proc:
        argv = [sys.executable, "-m", "sglang_patch.reference_server",
                "--port", str(self.server_port), "--dump-dir", str(self.dump_dir),
                "--model", self.model, "--cache-dir", str(self.cache_dir),
                "--chunked-prefill-size", str(self.chunked_prefill_size), "--threads", "1",
                *(extra or [])]
        proc = self._start("server", argv)
        wait_until(lambda: self._server_up(proc), 120, "the reference server")
        return proc

    def _server_up(self, proc: Proc) -> bool:
        if not proc.alive():
            raise RuntimeError(f"reference server exited; see {proc.log}")
        try:
            with socket.create_connection(("127.0.0.1", self.server_port), timeout=0.5):
                pass
        except OSError:
            return False
        return (self.dump_dir.is_dir()
                and any(self.dump_dir.glob(".ready.*")))

    def start_worker(self, name: str, concurrency: int = 2, extra: list[str] | None = None,
                     wait: bool = True, python: str = sys.executable,
                     prefix: list[str] | None = None) -> Proc:
        """A ``celery -A worker worker`` of ``python`` (another venv's, to test an install);
        ``prefix``: a command that runs it (``unshare --pid --fork --mount-proc``: another
        pid namespace, as in a container)."""
        argv = [*(prefix or []), python, "-m", "celery", "-A", "worker", "worker",
                "-n", f"{name}@%h", "-c", str(concurrency), "--loglevel", "INFO", "-P", "prefork",
                "--without-gossip", "--without-mingle", *(extra or [])]
        proc = self._start(name, argv, self._farm_env())
        if wait:  # under a prefix, the pool processes are not the started process's children
            wait_until(lambda: self._worker_ready(proc, 0 if prefix else concurrency), 120,
                       f"worker {name}")
        return proc

    def _farm_env(self) -> dict[str, str]:
        """The environment of worker and CLI processes (``env``, maybe without torch)."""
        env = self.env()
        if self.workers_without_torch:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [NOTORCH, env.get("PYTHONPATH")]))
        return env

    def _worker_ready(self, proc: Proc, concurrency: int) -> bool:
        if not proc.alive():
            raise RuntimeError(f"worker {proc.name} exited; see {proc.log}")
        return b" ready." in proc.log.read_bytes() and len(proc.children()) >= concurrency

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        old = self.procs.get(name)
        if old is not None and old.alive():
            raise RuntimeError(f"{name} is already running")
        proc = Proc(name, argv, self.work_dir / "logs" / f"{name}.log",
                    env or self.env()).start()
        self.procs[name] = proc
        return proc

    def cli(self, *args: str, timeout_s: float = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``python -m producer ARGS`` against this farm (``env``: added variables)."""
        return subprocess.run([sys.executable, "-m", "producer", *args],
                              env={**self._farm_env(), **(env or {})},
                              capture_output=True, text=True, timeout=timeout_s)

    def start_flower(self, port: int, basic_auth: str) -> Proc:
        """Flower (``celery -A worker flower``) on loopback, watching this farm's events."""
        argv = [sys.executable, "-m", "celery", "-A", "worker", "flower", "--address=127.0.0.1",
                f"--port={port}", f"--basic-auth={basic_auth}"]
        proc = self._start("flower", argv, self._farm_env())
        wait_until(lambda: _answers(proc, port, "/healthcheck"), 60, "flower")
        return proc

    def start_dashboard(self, port: int, *args: str) -> Proc:
        """``python -m producer dashboard`` on loopback; ``args``: its auth and other flags."""
        argv = [sys.executable, "-m", "producer", "dashboard", "--port", str(port), *args]
        proc = self._start("dashboard", argv, self._farm_env())
        wait_until(lambda: _answers(proc, port, "/"), 60, "the dashboard")
        return proc

    def close(self, kill: bool = False) -> None:
        """Stop workers first (they restore unacked messages), then the server, then Redis.

        ``kill``: SIGKILL every process group at once instead (a test's teardown: nothing
        of the farm outlives it, and there is nothing to shut down gracefully for).
        """
        last = ("server", "redis")
        order = sorted(self.procs.values(),
                       key=lambda p: last.index(p.name) if p.name in last else -1)
        for proc in order:
            if kill:
                proc.kill_group()
            else:
                proc.stop()
