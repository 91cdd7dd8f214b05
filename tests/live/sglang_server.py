"""A real ``python -m sglang.launch_server`` on this CPU-only machine, as a test subprocess.

The server runs in SGLang's own interpreter (``.venv-sglang``, built by ``make``; another one
with ``HSFARM_SGLANG_PYTHON``), the tests in the farm's (``.venv``): they talk to it only as a
worker does, over HTTP and through the dump dir. The plugin is loaded by SGLang's own plugin
loader in the scheduler processes, from the hsfarm install in that interpreter.

What makes SGLang 0.5.23 run on a CPU without AMX (``docs/sglang-live.md``): the CPU engine,
the torch-native attention backend, a bounded KV cache, and the test-only ``sgl_kernel``
stand-in of ``tests/sglang/cpu_kernel`` on the server's ``PYTHONPATH`` (one function in torch;
every other name raises).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.localfarm.farm import Proc, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_SCRIPT = ROOT / "ops" / "launch-sglang.sh"
CPU_KERNEL = ROOT / "tests" / "sglang" / "cpu_kernel"
ENV_PYTHON = "HSFARM_SGLANG_PYTHON"
START_TIMEOUT_S = 300.0  # 20-26 s on a quiet machine, 43-54 s under load; TP=2 more
PORT_TRIES = 3  # start-ups that lost a port SGLang derives from --port to another process

# The hook's own flags (README), then what a CPU run needs.
HOOK_FLAGS = ["--disable-radix-cache", "--disable-prefill-cuda-graph",
              "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
# --sleep-on-idle: an idle scheduler otherwise polls its sockets on one of this machine's two
# cores (9.8 CPU-s in 10 s, measured; 0.04 with it, and it wakes on a request's arrival),
# which the tests' transformers references and workers then share
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native",
             "--max-total-tokens", "65536", "--skip-server-warmup", "--sleep-on-idle"]


def sglang_python() -> Path:
    """SGLang's interpreter. A missing one is an error, never a skip: CI must run these."""
    path = Path(os.environ.get(ENV_PYTHON) or ROOT / ".venv-sglang" / "bin" / "python")
    if not path.exists():
        raise FileNotFoundError(f"no SGLang interpreter at {path}: run `make "
                                f".venv-sglang/.installed` or set {ENV_PYTHON}")
    return path


@dataclass
class LiveServer:
    """One SGLang server: its flags, dump dir (None: launched without the plugin's variable)."""

    model: Path
    work_dir: Path
    dump_dir: Path | None
    tp: int = 1
    flags: list[str] = field(default_factory=lambda: list(HOOK_FLAGS))
    extra: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    via_script: bool = False  # launched by ops/launch-sglang.sh (ready = its probe passed)
    proc: Proc | None = None
    started_s: float = 0.0  # seconds from launch to answering with the hook ready
    log_offset: int = 0  # the log's size at the last launch (a restart appends to it)

    @property
    def dumps(self) -> Path:
        """The dump dir of a server launched with the plugin's variable."""
        assert self.dump_dir is not None, "this server runs without SGLANG_HS_DUMP_DIR"
        return self.dump_dir

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.work_dir / f"sglang-{self.port}.log"

    def argv(self) -> list[str]:
        if self.via_script:  # the script adds the hook's flags and --tp-size/--port itself
            return ["bash", str(LAUNCH_SCRIPT), *CPU_FLAGS, *self.extra]
        return [str(sglang_python()), "-m", "sglang.launch_server",
                "--model-path", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), "--tp-size", str(self.tp),
                *CPU_FLAGS, *self.flags, *self.extra]

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("SGLANG_HS_DUMP_DIR", "PYTHONPATH", "VIRTUAL_ENV")}
        # the stand-ins, then this tree's hsfarm (the plugin under test, whatever the venv has)
        env.update({"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": f"{CPU_KERNEL}{os.pathsep}{ROOT}",
                    "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"})
        if self.dump_dir is not None:
            env["SGLANG_HS_DUMP_DIR"] = str(self.dump_dir)
        if self.via_script:
            assert self.dump_dir is not None
            env.update({"FARM_MODEL_PATH": str(self.model), "SGLANG_TP": str(self.tp),
                        "FARM_SERVER_URL": f"http://127.0.0.1:{self.port}",
                        "FARM_DUMP_DIR": str(self.dump_dir), "PYTHON": str(sglang_python())})
        if self.tp > 1:
            # one thread per rank on its own core (SGLang asserts a binding on CPU), and no
            # NCCL: the torch wheel ships libnccl, which PyNccl would then try on CPU tensors
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1))
                                                          for i in range(self.tp))
            env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so"
        env.update(self.extra_env)
        return env

    def launch(self) -> Proc:
        """Start the server (not waiting); a fixed port survives a restart."""
        self.port = self.port or free_port()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        self.proc = Proc(f"sglang-{self.port}", self.argv(), self.log, self.env()).start()
        return self.proc

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LiveServer:
        """Launch and wait until it serves, and (with the plugin) the hook is ready.

        SGLang derives its other ports from ``--port`` (``dist_init_port`` = port + 233, ...):
        one taken meanwhile by another process of this machine stops its start-up; a port this
        call chose is then chosen again (a fixed one, a restart's, is kept: its test needs it)."""
        t0, chosen = time.monotonic(), not self.port
        for attempt in range(1, PORT_TRIES + 1):
            proc = self.launch()
            try:
                wait_until(self.ready, timeout_s, f"SGLang on port {self.port} (log {self.log})",
                           poll_s=0.5)
                break
            except RuntimeError as e:
                proc.kill_group()
                if not (chosen and attempt < PORT_TRIES and _port_taken(str(e))):
                    raise
                self.port = 0  # launch chooses a free one again
            except BaseException:  # a server that did not start never outlives its test
                proc.kill_group()
                raise
        self.started_s = time.monotonic() - t0
        return self

    def ready(self) -> bool:
        if self.proc is None or not self.proc.alive():
            raise RuntimeError(f"SGLang exited during start-up:\n{self.log_tail()}")
        if self.via_script:
            return b"\nready\n" in self.log.read_bytes()[self.log_offset:]
        try:
            get_json(self.url, "/model_info")
        except (OSError, urllib.error.URLError):
            return False
        return self.dump_dir is None or bool(self.markers())

    def pids_titled(self, titles: dict[int, str]) -> dict[int, int]:
        """key → pid of this server's process whose command line holds ``titles[key]`` (SGLang
        titles its schedulers by rank: ``scheduler_TP1``, ``scheduler_DP1_TP1``)."""
        assert self.proc is not None
        found = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if os.getpgid(int(proc.name)) != self.proc.pid:
                    continue
                title = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:  # gone meanwhile (ProcessLookupError is an OSError)
                continue
            found.update({key: int(proc.name) for key, t in titles.items() if t in title})
        return found

    def markers(self) -> list[Path]:
        """The ready markers in the dump dir (temp files excluded)."""
        if not self.dumps.is_dir():
            return []
        return [p for p in self.dumps.glob(".ready.*") if ".tmp." not in p.name]

    def wait_exit(self, timeout_s: float = START_TIMEOUT_S) -> int:
        """For launches meant to fail: the exit code once the server has died."""
        assert self.proc is not None and self.proc.popen is not None
        return self.proc.popen.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL every process of the server at once (launcher, schedulers, detokenizer)."""
        assert self.proc is not None
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        assert self.proc.popen is not None
        self.proc.popen.wait(30)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout_s=20)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def generate(self, rid: str, ids: list[int], max_new_tokens: int = 0,
                 timeout_s: float = 300, dp_rank: int | None = None) -> dict[str, Any]:
        """``POST /generate`` as the worker sends it (``max_new_tokens`` 0: prefill only);
        with ``max_new_tokens`` > 0 the request decodes that many tokens, EOS or not;
        ``dp_rank`` pins it to that DP group (SGLang's ``routed_dp_rank``)."""
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        if max_new_tokens:
            params.update({"temperature": 0.0, "ignore_eos": True})
        body: dict[str, Any] = {"rid": rid, "input_ids": ids, "sampling_params": params}
        if dp_rank is not None:
            body["routed_dp_rank"] = dp_rank
        return post_json(self.url, "/generate", body, timeout_s)

    def health(self, timeout_s: float = 120) -> int:
        """SGLang's ``/health_generate``: a real forward pass of its own HEALTH_CHECK_* rid."""
        return get_status(self.url, "/health_generate", timeout_s)


def get_status(url: str, path: str, timeout_s: float) -> int:
    with urllib.request.urlopen(url + path, timeout=timeout_s) as resp:
        resp.read()
        return int(resp.status)


def get_json(url: str, path: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url + path, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def post_json(url: str, path: str, body: Any, timeout_s: float) -> Any:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


# SGLang's words when a port it derives from ``--port`` is taken (server_args.py, network.py)
_PORT_TAKEN = ("is not available in", "Port is already in use", "Address already in use")


def _port_taken(log_tail: str) -> bool:
    """The start-up failed on a port another process held: the machine's, not the test's."""
    return any(m in log_tail for m in _PORT_TAKEN)
