"""Kimi-K2.5's code path (``DeepseekV3ForCausalLM``: MLA attention, routed + shared experts,
yarn rope, a dense first layer) in live servers: the dumps equal transformers.

SGLang's own DeepSeek model code, its aux capture, ``LogitsProcessor`` and the hsfarm plugin
run unchanged. What SGLang 0.5.23 lacks on this CPU (no AMX) is stood in for in plain torch by
the test-only plugin of ``tests/sglang/cpu_kernel/hsfarm_cpu_standins`` (the MHA prefill of
MLA on ``torch_native``), each stand-in checked on its own in ``tests/sglang``. Two servers,
one at a time: unchunked (one request; several sharing one batch), and
``--chunked-prefill-size 16`` (prompts of ours in 16-token chunks, chunks of several requests
in one batch: later chunks run SGLang's absorbed-MLA path over the latent KV pool).

The servers compute in float32 (``--dtype float32``): with weights that make every sublayer
count, fp16 arithmetic moves a token whose two best experts score within ~1e-3 to the other
expert, and that token's error then spreads through attention to the tokens after it. So the
prompts are also checked to route clearly (``routing_margin``) before they are sent. Dynamo is
off (``TORCHDYNAMO_DISABLE=1``): SGLang's expert selection is a ``torch.compile`` function
whose inductor build costs ~50 s of CPU at the first prefill; the same Python runs eagerly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_dump.dumpfile import T_AUX, T_INPUT_IDS
from engine_dump.rids import make_rid, parse_rid
from tests.conftest import CACHE
from tests.live.conftest import measured, running
from tests.live.reference import _model, check_dump, layer_errors, relative_error
from tests.live.sglang_server import LiveServer, get_json
from tests.live.tiny_deepseek import (
    ensure_tiny_deepseek,
    ensure_tiny_kimi,
    routing_margin,
    sublayer_shares,
)
from tests.live.traffic import PREFILL_LINE, Req, log_lines_since, ours, send, wait_dump

LAYERS = [2, 4, 5]  # SGLang's default for 8 layers: [2, L//2, L-3]
CHUNK = 16
MIN_ROUTING_MARGIN = 1e-4  # float32 servers differ from transformers by ~1e-6 here
MIN_SUBLAYER_SHARE = 0.1  # every attention and MLP moves the residual by at least this much
SERVER_FLAGS = ["--dtype", "float32"]
SERVER_ENV = {"TORCHDYNAMO_DISABLE": "1"}


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return ensure_tiny_deepseek(CACHE, tiny_model)


def clear(model: Path, key: str, n: int, seed: int) -> Req:
    """A request of ours of ``n`` tokens whose routing is clear (the first seed from ``seed``
    whose prompt has a routing margin of at least MIN_ROUTING_MARGIN)."""
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    for s in range(seed, seed + 50):
        req = ours(key, n, s, vocab)
        if routing_margin(_model(model), req.ids) >= MIN_ROUTING_MARGIN:
            return req
    raise AssertionError(f"no prompt of {n} tokens with a clear routing from seed {seed}")


def record(what: str, model: Path, dumps: list[Path]) -> None:
    """Per captured layer: the worst and the mean per-token error over ``dumps``."""
    per: dict[str, list[tuple[float, float, int]]] = {}
    for path in dumps:
        n = len(load_file(str(path))[T_INPUT_IDS])
        for name, (worst, mean) in layer_errors(path, model).items():
            per.setdefault(name, []).append((worst, mean, n))
    cells = []
    for name, rows in per.items():
        worst = max(r[0] for r in rows)
        mean = sum(r[1] * r[2] for r in rows) / sum(r[2] for r in rows)
        cells.append(f"{name} {worst:.4f}/{mean:.4f}")
    measured(f"DeepSeek-V3 {what}, per layer worst/mean per-token error vs transformers: "
             + "; ".join(cells))


SHARING_ROUNDS = 4


def _again(req: Req, round_no: int) -> Req:
    """``req`` as its attempt ``1 + round_no``: the same ids under a rid of its own."""
    rid = parse_rid(req.rid)
    assert rid is not None
    return req if round_no == 0 else Req(
        make_rid(rid.sample_key, rid.attempt + round_no, rid.token_count, rid.run), req.ids,
        req.max_new_tokens)


def sharing_batches(server: LiveServer, model: Path, lead: Req, short: list[Req],
                    what: str) -> None:
    """Send ``lead`` and, while it runs, ``short`` at once: some share a prefill batch, and
    each dump equals transformers' states for its own ids (recorded per layer as ``what``).
    A loaded machine may prefill the lead before the others arrive: then all are sent again,
    as the next attempt, up to ``SHARING_ROUNDS`` times."""
    for round_no in range(SHARING_ROUNDS):
        lead_now, short_now = _again(lead, round_no), [_again(r, round_no) for r in short]
        offset = server.log.stat().st_size
        with ThreadPoolExecutor(max_workers=len(short) + 1) as pool:
            answers = send(server, [lead_now], pool) + send(server, short_now, pool)
            for answer in answers:
                answer.result()
        batches = log_lines_since(server, offset, PREFILL_LINE)
        most = max(int(b["seqs"]) for b in batches)
        if most >= 2:
            break
    assert most >= 2, [b.group(0) for b in batches]
    lead, short = lead_now, short_now
    dumps = [wait_dump(server.dumps, r.rid) for r in [lead, *short]]
    for path, r in zip(dumps, [lead, *short], strict=True):
        check_dump(path, model, r.ids, LAYERS)
    record(f"{what} (max {most} per batch)", model, dumps)


def test_the_tiny_model_makes_every_sublayer_and_its_routing_count(model: Path) -> None:
    # Given the tiny DeepSeek-V3 and a prompt
    ids = clear(model, "shares", 40, 1).ids
    # Then every attention and every MLP (dense, then routed + shared experts) moves the
    # residual by a sizeable fraction: a wrong one shows far above the bf16 tolerance
    shares = sublayer_shares(_model(model), ids)
    assert min(min(s) for s in shares) >= MIN_SUBLAYER_SHARE, shares
    config = json.loads((model / "config.json").read_text())
    assert (config["n_group"], config["routed_scaling_factor"]) == (2, 2.5)
    assert config["first_k_dense_replace"] == 1 and config["n_shared_experts"] == 1
    assert config["rope_scaling"]["rope_type"] == "yarn"


class TestUnchunked:
    """One server, default chunk budget (every prompt here prefilled whole)."""

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, module_dir: Path, model: Path) -> Iterator[LiveServer]:
        server = LiveServer(model, module_dir / "unchunked", module_dir / "unchunked" / "dumps",
                            extra=list(SERVER_FLAGS), extra_env=dict(SERVER_ENV))
        with running(server, "DeepSeek-V3 tiny (MLA, MoE), TP=1, unchunked"):
            yield server

    def test_the_hook_comes_up_once_sglang_sets_the_ids(self, server: LiveServer,
                                                         model: Path) -> None:
        # Then SGLang runs its own DeepSeek classes, and the hook came up with SGLang's default
        # ids for 8 layers, found after init_attention_backends, recorded in one marker
        assert get_json(server.url, "/model_info")["architectures"] == ["DeepseekV3ForCausalLM"]
        [marker] = server.markers()
        info = json.loads(marker.read_text())
        assert info["layers_to_capture"] == LAYERS
        assert info["ids_known"] == "after init_attention_backends"
        assert (info["hidden_size"], info["model_path"]) == (64, str(model))
        assert "hsfarm dump hook active" in server.log.read_text(errors="replace")

    def test_a_prefill_equals_transformers_at_each_layer_input(self, server: LiveServer,
                                                               model: Path) -> None:
        # Given a 40-token prompt of ours
        req = clear(model, "one", 40, 1)
        # When the server prefills it
        server.generate(req.rid, req.ids)
        # Then the dump holds transformers' states: aux column block j is the input of layer
        # LAYERS[j] (the output of layer LAYERS[j]-1 after its residual add, before any norm),
        # the final state is after the model's last norm
        dump_path = wait_dump(server.dumps, req.rid)
        check_dump(dump_path, model, req.ids, LAYERS)
        assert "test-only CPU stand-in in use: MLA prefill" in server.log.read_text()
        record("unchunked, one 40-token request", model, [dump_path])
        # And the comparison tells neighbouring layers apart: the captured rows are far from
        # the input of the layer before or after
        dump = load_file(str(dump_path))
        with torch.inference_mode():
            states = _model(model).model(torch.tensor([req.ids]),
                                         output_hidden_states=True).hidden_states
        for j, layer in enumerate(LAYERS):
            got = dump[T_AUX][:, j * 64:(j + 1) * 64]
            for other in (layer - 1, layer + 1):
                assert relative_error(got, states[other][0]) > 0.1, (layer, other)

    def test_several_requests_in_one_batch(self, server: LiveServer, model: Path) -> None:
        # Given a 120-token prompt of ours, then, while it runs, five short ones
        lead = clear(model, "lead", 120, 100)
        short = [clear(model, f"short-{i}", 5 + 7 * i, 200 + 50 * i) for i in range(5)]
        # When they are sent at once
        # Then some of them shared a prefill batch, and each dump holds exactly its own
        # request's states
        sharing_batches(server, model, lead, short, "unchunked, 6 requests sharing batches")


class TestChunked:
    """One server with ``--chunked-prefill-size 16``."""

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, module_dir: Path, model: Path) -> Iterator[LiveServer]:
        server = LiveServer(model, module_dir / "chunked", module_dir / "chunked" / "dumps",
                            extra=[*SERVER_FLAGS, "--chunked-prefill-size", str(CHUNK)],
                            extra_env=dict(SERVER_ENV))
        with running(server, f"DeepSeek-V3 tiny, TP=1, --chunked-prefill-size {CHUNK}"):
            yield server

    def test_prompts_in_16_token_chunks_sharing_batches(self, server: LiveServer,
                                                       model: Path) -> None:
        # Given two prompts of ours over 100 tokens and two short ones, sent at once
        reqs = [clear(model, "long-a", 150, 300), clear(model, "long-b", 101, 400),
                clear(model, "short-a", 9, 500), clear(model, "short-b", 3, 600)]
        offset = server.log.stat().st_size
        with ThreadPoolExecutor(max_workers=4) as pool:
            for answer in send(server, reqs, pool):
                answer.result()
        # Then the server prefilled them in chunks of at most 16 tokens, some chunks holding
        # rows of several requests
        batches = log_lines_since(server, offset, PREFILL_LINE,
                                  at_least=(150 + 101 + 9 + 3) // CHUNK)
        assert len(batches) >= (150 + 101 + 9 + 3) // CHUNK
        assert max(int(b["tokens"]) for b in batches) <= CHUNK
        assert max(int(b["seqs"]) for b in batches) >= 2, [b.group(0) for b in batches]
        # And each dump holds exactly transformers' states for its ids
        dumps = [wait_dump(server.dumps, r.rid) for r in reqs]
        for path, r in zip(dumps, reqs, strict=True):
            check_dump(path, model, r.ids, LAYERS)
        record(f"chunk {CHUNK}, prompts of 150/101/9/3 tokens sent at once", model, dumps)


class TestKimiK25:
    """One server with Kimi-K2.5's class, ``KimiK25ForConditionalGeneration`` (text only): its
    ``language_model`` is the tiny DeepSeek-V3, reached through Kimi's wrapper (which passes
    ``input_ids=None`` and embeddings to it), so transformers' DeepSeek-V3 of the same weights
    is the reference. Kimi's own processor is remote code that a local checkpoint lacks; the
    test-only text-only processor of ``hsfarm_cpu_standins.mm_processors`` takes its place."""

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, module_dir: Path, tiny_model: Path) -> Iterator[LiveServer]:
        kimi = ensure_tiny_kimi(CACHE, tiny_model)
        env = {**SERVER_ENV,
               "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE": "hsfarm_cpu_standins.mm_processors"}
        server = LiveServer(kimi, module_dir / "kimi", module_dir / "kimi" / "dumps",
                            extra=list(SERVER_FLAGS), extra_env=env)
        with running(server, "Kimi-K2.5 tiny (KimiK25ForConditionalGeneration), TP=1"):
            yield server

    def test_requests_through_kimis_wrapper_equal_transformers(self, server: LiveServer,
                                                              model: Path) -> None:
        # Given SGLang serving Kimi-K2.5's class, the hook up with the language model's ids
        assert get_json(server.url, "/model_info")["architectures"] == [
            "KimiK25ForConditionalGeneration"]
        [marker] = server.markers()
        assert json.loads(marker.read_text())["layers_to_capture"] == LAYERS
        # When a 120-token prompt of ours and, while it runs, three short ones are sent
        lead = clear(model, "kimi-lead", 120, 700)
        short = [clear(model, f"kimi-{i}", 4 + 9 * i, 800 + 50 * i) for i in range(3)]
        # Then some shared a batch, and each dump holds transformers' DeepSeek-V3 states
        sharing_batches(server, model, lead, short,
                        "through KimiK25ForConditionalGeneration, 4 requests sharing batches")
