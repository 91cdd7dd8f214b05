"""One live server (TP=1, ``--chunked-prefill-size 2048 --dtype float32``) and one request of
ours of 32,768 prompt tokens: the server prefills it in sixteen 2,048-token chunks and the dump
equals transformers' float32 forward of the same ids, layer by layer.

The model is this module's copy of the tiny Llama (its tokenizer, embeddings, norms and MLPs)
with two changes, read by the server and the reference alike:
- ``max_position_embeddings`` 33,024 instead of 32,768. SGLang 0.5.23 refuses a prompt of
  ``context - 6`` tokens or more (``max_req_input_len = context_len - 1 - 5``,
  ``managers/tp_worker.py``), so the model's own 32k context cannot take a 32,768-token prompt.
  In the config rather than with ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN``, so both sides
  read one file; with the default RoPE (``rope_theta`` only) the angles do not depend on
  ``max_position_embeddings`` in either, so positions 0..32,767 are the model's own.
- the attention projections redrawn with std ``1/sqrt(fan_in)`` (``conftest.attending_model``,
  which the chunked and TP=2 modules run on too). With the tiny Llama's own
  (std 0.02) attention is nearly uniform and moves the residual by a few percent, and at 32k the
  far prefix cannot be seen: measured in transformers, the last chunk's rows with the first
  2,048 tokens left out of its prefix, or with its positions shifted by one, are within 0.03%
  of the right ones, under the 2% tolerance. With the redrawn ones they are 24-115% and 29-47%
  off (worst token per layer), and a chunk without its prefix 200-350%.

The reference is transformers' default ``sdpa`` attention in one unchunked pass (eager's
32k x 32k float32 score matrix per head would be 4 GiB): no KV pool, no chunks, float32, its
own RoPE and causal mask; the server's ``torch_native`` backend runs each chunk's queries
against the keys and values it gathers from its KV pool. Both call torch's SDPA operator, which
is not what is under test here (the chunking, the pool, the capture and the dump are).

``--dtype float32`` (the tiny checkpoint's own; SGLang's ``auto`` picks float16 on CPU): each
chunk's ``torch_native`` attention runs over the whole prefix so far (the chunk's queries padded
to the prefix length), 5.8x one full 32k pass in all, and this CPU's float16 SDPA is the
slowest of the three dtypes (a causal 32k pass: float16 1.6 s, float32 1.0 s, bfloat16 0.8 s
per layer). In float32 the prefill took 41 s here against float16's 70 s, and what is left of
the error is the dump's bf16 rounding alone. A float16 server passed the same test once, worst
error 0.0063 (docs/sglang-live.md).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live.conftest import measured, running
from tests.live.reference import check_dump, layer_errors
from tests.live.sglang_server import LiveServer, get_json
from tests.live.traffic import PREFILL_LINE, log_lines_since, ours, vocab_size, wait_dump
from worker.server.limits import max_input_tokens

CHUNK = 2048
TOKENS = 32768
CONTEXT = TOKENS + 256  # above TOKENS + 6, SGLang's margin (the module docstring)
LAYERS = [2, 4, 5]  # SGLang's default for 8 layers: [2, L//2, L-3]
PREFILL_TIMEOUT_S = 600  # 16 chunks, each attending over the whole prefix so far


@pytest.fixture(scope="module", autouse=True)
def timed() -> Iterator[None]:
    """This module's wall time, launch to stop (its share of the suite's time)."""
    t0 = time.monotonic()
    yield
    measured(f"test_live_long.py in all: {time.monotonic() - t0:.1f}s")


@pytest.fixture(scope="module")
def long_model(module_dir: Path, attending_model: Path) -> Path:
    """The attending tiny Llama (``conftest.attending_model``) with a context of CONTEXT."""
    copy = module_dir / "tiny-llama-long"
    shutil.copytree(attending_model, copy)
    config = json.loads((copy / "config.json").read_text())
    assert config["max_position_embeddings"] < CONTEXT, config
    assert config["rope_parameters"]["rope_type"] == "default", config
    config["max_position_embeddings"] = CONTEXT
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


@pytest.fixture(scope="module")
def server(module_dir: Path, long_model: Path) -> Iterator[LiveServer]:
    flags = ["--chunked-prefill-size", str(CHUNK), "--dtype", "float32"]
    server = LiveServer(long_model, module_dir, module_dir / "dumps", extra=flags)
    with running(server, f"TP=1, context {CONTEXT}, --chunked-prefill-size {CHUNK}, float32"):
        yield server


def test_a_32k_prompt_in_2k_chunks_equals_transformers(server: LiveServer,
                                                       long_model: Path) -> None:
    # Given a server whose limits, as the worker reads them at start-up, take 32,768 tokens
    assert max_input_tokens(get_json(server.url, "/server_info")) == CONTEXT - 7 >= TOKENS
    # And one request of ours of 32,768 prompt tokens
    req = ours("long-32k", TOKENS, 32, vocab_size(long_model))
    offset = server.log.stat().st_size
    # When the server prefills it
    t0 = time.monotonic()
    server.generate(req.rid, req.ids, timeout_s=PREFILL_TIMEOUT_S)
    prefill_s = time.monotonic() - t0
    dump = wait_dump(server.dumps, req.rid)
    # Then it did so in sixteen chunks of exactly 2,048 tokens, one request each
    batches = log_lines_since(server, offset, PREFILL_LINE, at_least=TOKENS // CHUNK)
    chunks = [(int(b["seqs"]), int(b["tokens"])) for b in batches]
    assert chunks == [(1, CHUNK)] * (TOKENS // CHUNK), [b.group(0) for b in batches]
    # And the dump holds the ids and transformers' states for them at the same layers
    t0 = time.monotonic()
    worst = check_dump(dump, long_model, req.ids, LAYERS)
    reference_s = time.monotonic() - t0
    cells = [f"{name} {w:.4f}/{m:.4f}" for name, (w, m) in layer_errors(dump, long_model).items()]
    measured(f"{TOKENS:,} tokens in {CHUNK}-token chunks: prefill {prefill_s:.1f}s, "
             f"transformers {reference_s:.1f}s; worst error {worst:.4f}; per layer worst/mean "
             "per-token error vs transformers: " + "; ".join(cells))
