"""One live server (TP=1, ``--chunked-prefill-size 16 --enable-mixed-chunk``): dumps against
transformers with prompts over 1,000 tokens in 16-token chunks, requests sharing one batch,
decoding requests mixed into prefill batches, foreign rids, and ``verify`` against it.

On ``conftest.attending_model``, whose attention makes a wrong prefix show in the rows (with the
tiny Llama's own, a chunk that missed the first 16 tokens of its prefix is 0.05% off)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine_dump.rids import NO_RUN, RID_PREFIX
from producer.localfarm.farm import wait_until
from tests.live.conftest import measured, running
from tests.live.reference import BF16_TOLERANCE, _model, check_dump, relative_error
from tests.live.sglang_server import LiveServer, sglang_python
from tests.live.traffic import (
    PREFILL_LINE,
    Req,
    log_lines_since,
    ours,
    prompt,
    send,
    vocab_size,
    wait_dump,
)

CHUNK = 16
LAYERS = [2, 4, 5]  # SGLang's default for 8 layers: [2, L//2, L-3]


@pytest.fixture(scope="module")
def server(module_dir: Path, attending_model: Path) -> Iterator[LiveServer]:
    flags = ["--chunked-prefill-size", str(CHUNK), "--enable-mixed-chunk",
             "--decode-log-interval", "1"]
    server = LiveServer(attending_model, module_dir, module_dir / "dumps", extra=flags)
    with running(server, f"TP=1, --chunked-prefill-size {CHUNK} --enable-mixed-chunk"):
        yield server


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as p:
        yield p


def test_long_prompts_in_16_token_chunks_equal_transformers(
        server: LiveServer, attending_model: Path, pool: ThreadPoolExecutor) -> None:
    # Given a prompt of ours over 1,000 tokens and a short one, sent at once
    vocab = vocab_size(attending_model)
    reqs = [ours("long-a", 1030, 1, vocab), ours("long-b", 37, 2, vocab)]
    offset = server.log.stat().st_size
    # When the server prefills them
    for answer in send(server, reqs, pool):
        answer.result()
    # Then each dump holds exactly transformers' states for its ids, at the same layers
    errors = [check_dump(wait_dump(server.dumps, r.rid), attending_model, r.ids, LAYERS)
              for r in reqs]
    measured(f"chunk {CHUNK}, prompts of 1,030 and 37 tokens: worst per-token relative "
             f"error vs transformers {max(errors):.4f}")
    # And the server really prefilled them in chunks of at most 16 tokens
    batches = log_lines_since(server, offset, PREFILL_LINE, at_least=(1030 + 37) // CHUNK)
    assert len(batches) >= (1030 + 37) // CHUNK
    assert max(int(b["tokens"]) for b in batches) <= CHUNK


def test_a_chunk_that_missed_part_of_its_prefix_would_fail_the_check(
        attending_model: Path, tiny_model: Path) -> None:
    """The check above can fail: on this module's model, transformers' rows of a 1,030-token
    prompt's last chunk with the first chunk masked out of its prefix (positions kept) are off
    by more than the tolerance at every captured layer; on the tiny Llama's own they are not."""
    ids = torch.tensor([prompt(1030, 1, vocab_size(attending_model))])
    masked = torch.ones_like(ids)
    masked[0, :CHUNK] = 0

    def last_chunk_errors(model_dir: Path) -> list[float]:
        with torch.inference_mode():
            model = _model(model_dir).model
            want = model(ids, output_hidden_states=True).hidden_states
            got = model(ids, attention_mask=masked, output_hidden_states=True).hidden_states
        return [relative_error(got[i][0, -CHUNK:], want[i][0, -CHUNK:]) for i in LAYERS]

    attending, tiny = last_chunk_errors(attending_model), last_chunk_errors(tiny_model)
    measured("first 16 tokens masked out of a 1,030-token prefix, last chunk's error at layers "
             f"{LAYERS}: attending model {', '.join(f'{e:.3f}' for e in attending)}; the tiny "
             f"Llama's own {', '.join(f'{e:.4f}' for e in tiny)}")
    assert min(attending) > 2 * BF16_TOLERANCE, attending
    assert max(tiny) < BF16_TOLERANCE, tiny  # why the module does not run on it


def test_several_requests_share_one_batch_and_foreign_rids_get_no_dump(
        server: LiveServer, attending_model: Path, pool: ThreadPoolExecutor) -> None:
    # Given a 405-token prompt of ours (its last chunk leaves 11 tokens of the budget), then,
    # while it runs, six short prompts of ours, a foreign client's request and SGLang's own
    # health check (a real forward pass with a HEALTH_CHECK_* rid)
    vocab = vocab_size(attending_model)
    long = ours("lead", 405, 3, vocab)
    short = [ours(f"short-{i}", 3 + i % 3, 10 + i, vocab) for i in range(6)]
    foreign = [Req("chatcmpl-live-1", prompt(5, 20, vocab))]
    offset = server.log.stat().st_size
    # When they are sent at once
    answers = send(server, [long], pool) + send(server, short + foreign, pool)
    health = pool.submit(server.health)
    for answer in answers:
        answer.result()
    assert health.result() == 200
    # Then the requests shared prefill batches (the log shows batches of several new ones)
    batches = log_lines_since(server, offset, PREFILL_LINE)
    assert max(int(b["seqs"]) for b in batches) >= 2, [b.group(0) for b in batches]
    # And each request of ours has its own exact dump; the foreign ones have none
    errors = [check_dump(wait_dump(server.dumps, r.rid), attending_model, r.ids, LAYERS)
              for r in [long, *short]]
    measured(f"chunk {CHUNK}, 7 requests of ours sharing batches: worst error {max(errors):.4f}")
    names = {p.name for p in server.dumps.iterdir()}
    assert not any(r.rid in n for r in foreign for n in names), names


def test_mixed_chunk_with_decoding_requests_alongside(server: LiveServer, attending_model: Path,
                                                      pool: ThreadPoolExecutor) -> None:
    # Given two foreign requests and one of ours decoding 150 tokens each
    vocab = vocab_size(attending_model)
    decoders = [Req(f"chatcmpl-dec-{i}", prompt(20, 30 + i, vocab), 150) for i in range(2)]
    our_decoder = ours("decoding", 24, 40, vocab, max_new_tokens=150)
    offset = server.log.stat().st_size
    answers = send(server, [*decoders, our_decoder], pool)
    wait_until(lambda: bool(log_lines_since(server, offset, r"Decode batch")), 120,
               "the decoding requests to be running", poll_s=0.1)
    # When a 1,010-token prompt of ours is prefilled in chunks while they decode
    long = ours("mixed", 1010, 41, vocab)
    answers += send(server, [long], pool)
    for answer in answers:
        answer.result()
    # Then prefill chunks ran in batches with decoding requests mixed in
    batches = log_lines_since(server, offset, PREFILL_LINE)
    mixed = [b for b in batches if int(b["running"]) > 0]
    assert mixed, [b.group(0) for b in batches]
    # And both requests of ours dumped exactly their prompt (generated tokens are not prompt
    # rows), with no .err, and the foreign decoders nothing
    errors = [check_dump(wait_dump(server.dumps, r.rid), attending_model, r.ids, LAYERS)
              for r in (long, our_decoder)]
    measured(f"chunk {CHUNK} + mixed chunk, {len(mixed)} mixed batches: worst error "
             f"{max(errors):.4f}")
    assert not list(server.dumps.glob("*.err"))
    assert not list(server.dumps.glob("chatcmpl-*"))


def _verify(*args: str, python: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python or sglang_python()), "-m", "sglang_patch", "verify",
                           *args], capture_output=True, text=True, timeout=600)


def test_verify_probe_passes_against_this_server(server: LiveServer) -> None:
    # When verify checks the running server (its install checks, which import all of SGLang
    # once more, run in tests/sglang and in ops/launch-sglang.sh of test_live_farm.py)
    res = _verify("--live-only", "--dump-dir", str(server.dumps), "--server", server.url)
    # Then the marker and the probe pass, and the probe's dump was checked and removed
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("PASS") == 2, res.stdout
    assert "PASS  probe request: a 16-token request of ours" in res.stdout
    assert "layers [2, 4, 5], all finite" in res.stdout
    assert not list(server.dumps.glob("*_hsfarm_verify_*"))


def test_verify_probe_fails_with_a_wrong_dump_dir(server: LiveServer, tmp_path: Path) -> None:
    # Given a dump dir that is not the server's
    wrong = tmp_path / "elsewhere"
    wrong.mkdir()
    # When verify probes the server with it
    res = _verify("--live-only", "--dump-dir", str(wrong), "--server", server.url,
                  "--timeout-s", "5")
    # Then it fails, saying why and what to change
    assert res.returncode == 1, res.stdout
    assert f"FAIL  ready marker: none in {wrong}" in res.stdout
    assert "FAIL  probe request: the server answered the probe but no dump" in res.stdout
    assert "SGLANG_HS_DUMP_DIR must be this directory" in res.stdout
    # (the hook did dump the probe: in its own dir, where the farm's janitor would sweep it)
    strays: list[Path] = []

    def stray() -> bool:
        strays[:] = server.dumps.glob(f"{RID_PREFIX}{NO_RUN}-_hsfarm_verify_*")
        return bool(strays)

    wait_until(stray, 60, "the probe's dump in the server's own dump dir")
    assert len(strays) == 1
    strays[0].unlink()
