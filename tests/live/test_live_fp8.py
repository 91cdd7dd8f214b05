"""One live server storing fp8 (``SGLANG_HS_DUMP_DTYPE=fp8_e4m3``, chunks of 64 tokens), on a
tiny Llama of hidden size 256 (two blocks of 128 per layer): the hook quantizes inside SGLang
with a scale per block, the farm's own requests stay bf16, and the fp8 states read back (torch
and numpy, bit for bit) within e4m3's rounding of the bf16 ones of the same prompts."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine_dump import fp8 as codec
from engine_dump.dumpfile import (
    DTYPE_FP8,
    ENV_DUMP_DTYPE,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
)
from engine_dump.rids import INTERNAL_KEY_PREFIX, make_rid
from sglang_patch.tiny_model import ensure_tiny_model
from tests.live.conftest import measured, running
from tests.live.sglang_server import LiveServer
from tests.live.traffic import Req, prompt, send, vocab_size, wait_dump
from worker.core import fp8 as checks

H = 256


@pytest.fixture(scope="module")
def server(module_dir: Path) -> Iterator[LiveServer]:
    model = ensure_tiny_model(module_dir / "cache", hidden_size=H)
    server = LiveServer(model, module_dir, module_dir / "dumps",
                        extra=["--chunked-prefill-size", "64"],
                        extra_env={ENV_DUMP_DTYPE: DTYPE_FP8})
    with running(server, "TP=1, fp8_e4m3 dumps, H = 256"):
        yield server


def test_the_live_hook_stores_block_scaled_fp8_within_e4m3s_rounding(
        server: LiveServer) -> None:
    # Given prompts sent twice: as samples (dumped fp8) and as the farm's own (dumped bf16)
    vocab = vocab_size(server.model)
    reqs = []
    for i, n in enumerate((35, 142, 300)):
        ids = prompt(n, i, vocab)
        reqs += [Req(make_rid(f"p{i}", 1, n), ids),
                 Req(make_rid(f"{INTERNAL_KEY_PREFIX}p{i}", 1, n), ids)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for answer in send(server, reqs, pool):
            answer.result()
    worst = 0.0
    for sample, own in zip(reqs[::2], reqs[1::2], strict=True):
        got = load_file(str(wait_dump(server.dumps, sample.rid)))
        ref = load_file(str(wait_dump(server.dumps, own.rid)))
        n = len(sample.ids)
        # Then the sample's dump holds e4m3 with a scale per block of 128 values per layer
        assert got[T_AUX].dtype == torch.float8_e4m3fn
        assert got[T_HIDDEN_SCALE].shape == (n, 2) and got[T_AUX_SCALE].shape == (n, 6)
        assert ref[T_AUX].dtype == torch.bfloat16 and T_AUX_SCALE not in ref
        for name, scale, layers in ((T_HIDDEN, T_HIDDEN_SCALE, 1),
                                    (T_AUX, T_AUX_SCALE, 3)):
            q, s = got[name].view(torch.uint8), got[scale]
            back = codec.dequantize(q, s, torch.float32, layers=layers)
            # And numpy (the worker's, the training side's) reads torch's values bit for bit
            np_back = checks.dequantize(q.numpy(), s.numpy(), layers=layers)
            assert np.array_equal(np_back.view(np.uint32), back.numpy().view(np.uint32))
            # And they are the bf16 states up to e4m3's rounding (per token and layer, L2)
            want = ref[name].float().view(n, layers, H)
            err = (back.view(n, layers, H) - want).norm(dim=2) / want.norm(dim=2)
            worst = max(worst, float(err.max()))
    assert worst < 0.05, worst
    measured(f"fp8 (blocks of 128, H = 256) vs bf16 dumps of the same prompts: worst "
             f"per-token L2 error {worst:.4f}")
