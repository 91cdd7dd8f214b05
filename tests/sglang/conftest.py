"""Tests against the real SGLang 0.5.23 source, run in .venv-sglang (see the Makefile).

That venv has SGLang's Python package and what it imports on a CPU-only machine; nothing of
SGLang is mocked. The hook inside whole live servers is tested in tests/live (real
``sglang.launch_server`` processes); what stays here is what a live 0.5.23 server on CPU cannot
show, with a stand-in ModelRunner where one is needed (each test says so): layouts that cannot
be launched here, capture ids that arrive late or never, gaps and truncation.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

warnings.filterwarnings("ignore")


@pytest.fixture(scope="session")
def sglang_ctx() -> Any:
    """SGLang's runtime context, published for one CPU rank (attention-TP rank 0)."""
    from sglang.srt.runtime_context import get_context, get_parallel

    get_context().override_server_args(device="cpu").install()
    get_parallel().override_permanently(attn_tp_rank=0, tp_rank=0, attn_tp_size=1, tp_size=1)
    return get_parallel()


@pytest.fixture(scope="session")
def plugins_loaded(tmp_path_factory: pytest.TempPathFactory, sglang_ctx: Any) -> Path:
    """SGLang's own load_plugins(), with the variable set: our hooks applied for real."""
    dump_dir = tmp_path_factory.mktemp("dumps")
    os.environ["SGLANG_HS_DUMP_DIR"] = str(dump_dir)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return dump_dir


@pytest.fixture
def hook(plugins_loaded: Path, tmp_path: Path) -> Iterator[Any]:
    """This process's DumpHook, as around_load_model installs it on attn-TP rank 0."""
    from sglang_patch import plugin
    from sglang_patch.sglang_hook import DumpHook

    plugin._hook = DumpHook(tmp_path, {"layers_to_capture": "[2, 4, 5]"}, reserve_bytes=0)
    yield plugin._hook
    plugin._hook.writer.close()
    plugin._hook = None
