"""A fork server for the suite's reference servers: torch and transformers imported once.

The suite starts the reference server (``python -m sglang_patch.reference_server``) about a
hundred times, and each start spent ~6 s of CPU importing torch and transformers before any of
hsfarm's code ran: some ten minutes of a 2-core machine's suite. A test process's farms
(``producer.localfarm.farm.launcher``) now ask this server instead: one process per pytest
process that has imported those libraries (nothing of hsfarm's, and no torch computation, so
no thread pool is forked), and forks a child per start, which becomes exactly what the command
would have been: its own session (the harness kills its process group), its log on stdout and
stderr, the command's environment, working directory and ``sys.argv``, and the module run as
``__main__``; its exit status comes back as Popen's would (a signal as its negative number).
hsfarm's own modules are imported by each child, from the tree, as a plain start imports them.

What a fork cannot give, it does not serve (the farm then starts the plain command): another
interpreter or another module. A command whose environment differs in a variable read at import
time (``import_env``) forks from another server begun with that environment, up to four a
process. Plain starts of the same server remain in the suite: the
documented commands, the demo, the multi-host test (its own Popen in a network namespace) and
the benches start it without this.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

MODULE = "sglang_patch.reference_server"
ROOT = Path(__file__).resolve().parents[2]
# Variables read when the preloaded libraries are imported (or by the interpreter at start):
# a command whose values differ forks from a server begun with them (``ForkServer``).
_IMPORT_ENV_PREFIXES = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "OMP_", "MKL_",
                        "KMP_", "CUDA", "LD_", "TOKENIZERS_", "XDG_CACHE")


def import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_ENV_PREFIXES) and k != "PYTHON"}


def serves(given: dict[str, str], before: dict[str, str], after: dict[str, str]) -> bool:
    """Whether a command of environment ``given`` may fork from a server that was started with
    ``before`` and whose preload left ``after`` (import environments): each variable is as the
    server began, or is what the preload itself set it to (torch sets TORCHINDUCTOR_CACHE_DIR
    at import; a plain start's import would have found it so, and left it)."""
    for key in given.keys() | before.keys() | after.keys():
        value = given.get(key)
        if value == before.get(key):
            continue
        if before.get(key) != after.get(key) and value == after.get(key):
            continue
        return False
    return True


def preload() -> None:
    """What every reference server imports before hsfarm's first line: no computation."""
    import aiohttp.web  # noqa: F401
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import transformers.models.llama.modeling_llama
    from transformers import (  # noqa: F401  (transformers resolves these lazily)
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        DynamicCache,
        PreTrainedTokenizerFast,
    )

    del transformers


# --- the server process ---------------------------------------------------------------------

def serve(sock_path: str, parent: int, with_preload: bool = True) -> None:
    """Accept start requests on ``sock_path`` until the pytest process that started us is gone
    (its children keep running: each is in its own session, and its harness stops it)."""
    before = import_env(dict(os.environ))
    if with_preload:
        preload()
    after = import_env(dict(os.environ))
    added = {k: v for k, v in after.items() if before.get(k) != v}
    with open(sock_path + ".env", "w") as f:  # the client's check of each command's variables
        json.dump({"before": before, "after": after}, f)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path + ".part")
    listener.listen(64)
    os.rename(sock_path + ".part", sock_path)  # the client waits for this name: ready
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "accept":
                conn, _ = listener.accept()
                _start(conn, children, [listener, wake_r, wake_w, *children.values()], sel,
                       added)
            else:
                while True:
                    try:
                        if not wake_r.recv(512):
                            break
                    except BlockingIOError:
                        break
        _reap(children)


def _start(conn: socket.socket, children: dict[int, socket.socket],
           others: list[socket.socket], sel: selectors.BaseSelector,
           added: dict[str, str]) -> None:
    try:
        conn.settimeout(30)
        request = json.loads(conn.makefile("rb").readline())
    except (OSError, ValueError):
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        sel.close()
        for s in others:
            s.close()
        _become(request, conn, added)
    children[pid] = conn
    with contextlib.suppress(OSError):
        conn.sendall(f"pid {pid}\n".encode())


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _become(request: dict[str, Any], conn: socket.socket, added: dict[str, str]) -> None:
    """The forked child: become the requested command, then exit as its interpreter would
    (``added``: what the preload set in the environment, as a plain start's import would)."""
    code = 1
    try:
        conn.close()
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for key, value in added.items():
            os.environ.setdefault(key, value)
        argv = request["argv"]
        sys.path[0] = os.getcwd()  # as ``python -m`` sets it
        sys.argv = [argv[2], *argv[3:]]
        try:
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter exits:
        atexit._run_exitfuncs()  # non-daemon threads joined, then the atexit functions
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


# --- the client, in the pytest process ------------------------------------------------------
# (hsfarm's helpers are imported inside it: the server process runs this module, and imports
# nothing of hsfarm's before it forks)

class ForkedChild:
    """A started child, as much of ``subprocess.Popen`` as the farm uses."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn: socket.socket | None = conn
        self._buf = b""
        self._ticks = _start_ticks(pid)  # the pid's start time: a reused pid is another process

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def _read(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if self._conn is None:  # the fork server went first: the pid's own fate
                if self._ticks is None or _start_ticks(self.pid) != self._ticks:
                    self.returncode = -signal.SIGKILL
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    return
                time.sleep(0.05)
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._conn.settimeout(left)
            try:
                data = self._conn.recv(64)
            except (TimeoutError, BlockingIOError):
                return
            if not data:
                self._conn.close()
                self._conn = None
                continue
            self._buf += data
            if b"\n" in self._buf:
                word, value = self._buf.split(b"\n", 1)[0].split()
                assert word == b"exit", self._buf
                self.returncode = int(value)
                self._conn.close()
                self._conn = None


def _start_ticks(pid: int) -> str | None:
    from engine_dump.process_identity import start_ticks

    return start_ticks(pid)


class Zygote:
    """One server process: begun with one environment, it forks the starts it ``serves``."""

    def __init__(self, env: dict[str, str], preload: bool) -> None:
        self.dir = tempfile.mkdtemp(prefix="hsfarm-forkserver-")
        self.sock = os.path.join(self.dir, "sock")
        with open(os.path.join(self.dir, "log"), "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.forkserver", self.sock,
                 str(os.getpid()), "preload" if preload else "bare"],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.env_before: dict[str, str] = {}
        self.env_after: dict[str, str] = {}

    def ready(self) -> bool:
        """Wait until it listens (its preload done); False: it did not start."""
        from producer.localfarm.farm import wait_until

        try:
            wait_until(self._listening, 180, "the fork server", poll_s=0.05)
        except (TimeoutError, RuntimeError):
            return False
        with open(self.sock + ".env") as f:
            seen = json.load(f)
        self.env_before, self.env_after = seen["before"], seen["after"]
        return True

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError("the fork server exited")
        return os.path.exists(self.sock)

    def serves(self, env: dict[str, str]) -> bool:
        return serves(import_env(env), self.env_before, self.env_after)

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedChild:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(30)
        conn.connect(self.sock)
        conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(),
                                 "log": str(log)}).encode() + b"\n")
        line = conn.makefile("rb").readline().split()
        return ForkedChild(argv, int(line[1]), conn)

    def log_tail(self) -> str:
        log = Path(self.dir, "log")
        return log.read_text(errors="replace")[-2000:] if log.is_file() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class ForkServer:
    """The client: asks a server process for every start of ``module`` (``preload``: False for
    a module that needs nothing imported first: this file's own test). A start whose
    environment no running server ``serves`` begins another with it (a test may set, in this
    process, a variable the preload never reads: chat.py sets TRANSFORMERS_NO_ADVISORY_WARNINGS
    for its own warnings), up to ``MAX_ZYGOTES``; past that it is left to a plain start."""

    MAX_ZYGOTES = 4

    def __init__(self, module: str = MODULE, preload: bool = True) -> None:
        self.module = module
        self.preload = preload
        self.zygotes: list[Zygote] = []
        self._broken = False
        self.forked = self.plain = 0  # starts of ``module``: forked, and left to a plain start
        atexit.register(self.close)

    def __call__(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedChild | None:
        if argv[:3] != [sys.executable, "-m", self.module]:
            return None
        zygote = self._zygote(env)
        if zygote is None:
            self.plain += 1
            return None
        try:
            child = zygote.fork(argv, env, log)
        except (OSError, ValueError, IndexError) as e:
            self._fail(f"a start failed ({e!r})", zygote)
            self.plain += 1
            return None
        self.forked += 1
        return child

    def _zygote(self, env: dict[str, str]) -> Zygote | None:
        if self._broken:
            return None
        for zygote in self.zygotes:
            if zygote.serves(env):
                return zygote
        if len(self.zygotes) >= self.MAX_ZYGOTES:
            return None
        zygote = Zygote(env, self.preload)
        self.zygotes.append(zygote)
        if not zygote.ready():
            self._fail("it did not start", zygote)
            return None
        return zygote if zygote.serves(env) else None

    def _fail(self, why: str, zygote: Zygote) -> None:
        print(f"forkserver: {why}; reference servers start plainly from now on\n"
              f"{zygote.log_tail()}", file=sys.stderr)
        self._broken = True
        self.close()

    def close(self) -> None:
        for zygote in self.zygotes:
            zygote.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), with_preload=sys.argv[3] == "preload")
