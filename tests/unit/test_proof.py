"""The proof's arithmetic on small arrays, against a plain float64 log_softmax: the LM head read
from a checkpoint, the rows it checks, the rows read from a dump, the verdict, and the
server's answers in each engine's shape."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine_dump import engines
from engine_dump.dumpfile import DTYPE_BF16, T_HIDDEN, T_HIDDEN_SCALE
from worker.core import proof, tensorfile
from worker.core.fp8 import E4M3_VALUES

pytestmark = pytest.mark.timeout(60)
V, H = 300, 24


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bf16 bits (uint16), rounded to nearest even."""
    return (proof.round_bf16(x).view(np.uint32) >> 16).astype(np.uint16)


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def plain_logprobs(w: np.ndarray, hidden: np.ndarray, targets: np.ndarray,
                   bf16_logits: bool = False) -> np.ndarray:
    """The reference: the whole logits matrix at once, log_softmax in float64."""
    logits = (hidden.astype(np.float32) @ w.astype(np.float32).T)
    if bf16_logits:
        logits = widen(bf16_bits(logits))
    x = logits.astype(np.float64)
    lse = x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))
    return x[np.arange(len(targets)), targets] - lse


def checkpoint(tmp_path: Path, tensors: dict[str, tensorfile.Tensor], tied: bool = False) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    tensorfile.write(tmp_path / "model.safetensors", tensors, {"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": H,
                                                      "tie_word_embeddings": tied}))
    return tmp_path


def head_weights(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.3, (V, H)).astype(np.float32)


def test_recomputed_logprobs_equal_a_plain_log_softmax_over_chunks(tmp_path: Path) -> None:
    # Given a bf16 LM head in a checkpoint and a few bf16 rows of a final state
    w = widen(bf16_bits(head_weights()))
    path = checkpoint(tmp_path, {"model.norm.weight": tensorfile.Tensor("BF16", bf16_bits(
        np.ones(H, np.float32))), "lm_head.weight": tensorfile.Tensor("BF16", bf16_bits(w))})
    head = proof.open_lm_head(path, H)
    rng = np.random.default_rng(1)
    hidden = widen(bf16_bits(rng.normal(0, 2, (7, H)).astype(np.float32)))
    targets = rng.integers(0, V, 7)

    # When it is recomputed 50 vocabulary rows at a time (6 chunks)
    got = proof.recompute(head, hidden, targets, chunk_bytes=50 * 4 * H)

    # Then both variants equal the whole-matrix reference, to float64 rounding
    assert head.name == "lm_head.weight" and head.dtype == "BF16" and head.vocab_size == V
    np.testing.assert_allclose(got.logprob, plain_logprobs(w, hidden, targets), atol=1e-9)
    np.testing.assert_allclose(got.logprob_bf16, plain_logprobs(w, hidden, targets, True),
                               atol=1e-9)
    assert (got.magnitude > 0).all()


def test_a_correct_row_agrees_and_shifted_or_foreign_rows_do_not(tmp_path: Path) -> None:
    # Given a float32 head and a sequence whose "server" logprobs come from its true rows,
    # computed as an engine running in bf16 computes them (bf16 logits)
    w = head_weights(2) * 3
    head = proof.open_lm_head(checkpoint(tmp_path, {"lm_head.weight": tensorfile.Tensor(
        "F32", w)}), H)
    rng = np.random.default_rng(3)
    n = 200
    states = widen(bf16_bits(rng.normal(0, 1, (n, H)).astype(np.float32)))
    ids = rng.integers(0, V, n)
    server = np.full(n, np.nan)
    server[1:] = plain_logprobs(w, states[:-1], ids[1:], bf16_logits=True)
    rows = proof.pick_rows(n, 16, "rid-1")

    # When the true rows, the rows shifted by one and another sample's rows are proven
    right = proof.prove(head, states[rows], rows, ids, server, DTYPE_BF16)
    shifted = proof.prove(head, states[rows + 1], rows, ids, server, DTYPE_BF16)
    foreign = proof.prove(head, states[::-1][rows], rows, ids, server, DTYPE_BF16)

    # Then the true rows agree to float rounding, the others fail on most rows
    assert right.ok and right.rows == 16 and right.worst_error < 1e-6, right.describe()
    for wrong in (shifted, foreign):
        assert not wrong.ok and len(wrong.failed) >= 12, wrong.describe()
        assert "rows off" in wrong.describe()


def test_a_missing_server_value_fails_the_row() -> None:
    # Given a verdict over two rows, the server's value of one missing (NaN)
    ours = proof.Recomputed(np.array([-1.0, -2.0]), np.array([-1.0, -2.0]), np.ones(2))

    # When compared
    v = proof.compare(np.array([0, 5]), ours, np.array([-1.0, np.nan]), DTYPE_BF16)

    # Then that row fails
    assert not v.ok and v.failed == (5,)


def test_rows_spread_over_the_sequence_and_stay_the_same_per_rid() -> None:
    # Given a 1,000-token sample and 32 rows
    rows = proof.pick_rows(1000, 32, "rid-a")

    # Then one row falls in each thirty-second of rows 0..998, none twice, none the last
    assert len(rows) == 32 and len(set(rows.tolist())) == 32
    assert rows.min() >= 0 and rows.max() <= 998
    assert np.all(np.diff(rows) > 0)
    assert all(int(i * 999 / 32) <= r <= (i + 1) * 999 / 32 for i, r in enumerate(rows))
    # And the same rid draws the same rows, another rid others
    assert (proof.pick_rows(1000, 32, "rid-a") == rows).all()
    assert not (proof.pick_rows(1000, 32, "rid-b") == rows).all()
    # And a short sample has all its rows checked; one token has none
    assert proof.pick_rows(5, 32, "x").tolist() == [0, 1, 2, 3]
    assert proof.pick_rows(1, 32, "x").tolist() == []


def test_the_rate_picks_that_share_of_samples_the_same_on_every_attempt() -> None:
    keys = [f"sample-{i}" for i in range(4000)]
    share = sum(proof.chosen(k, 0.05) for k in keys) / len(keys)
    assert 0.04 < share < 0.06
    assert [proof.chosen(k, 0.05) for k in keys[:50]] == [proof.chosen(k, 0.05)
                                                          for k in keys[:50]]
    assert all(proof.chosen(k, 1.0) for k in keys[:20])
    assert not any(proof.chosen(k, 0.0) for k in keys[:20])


def test_the_head_is_the_embedding_when_tied_and_refused_when_quantized(tmp_path: Path) -> None:
    # Given a tied checkpoint (no lm_head), and checkpoints whose head is quantized
    embed = tensorfile.Tensor("F32", head_weights())
    tied = checkpoint(tmp_path / "tied", {"model.embed_tokens.weight": embed}, tied=True)
    untied = checkpoint(tmp_path / "untied", {"model.embed_tokens.weight": embed})
    packed = checkpoint(tmp_path / "packed", {
        "lm_head.weight_packed": tensorfile.Tensor("I32", np.zeros((V, H // 8), np.int32)),
        "lm_head.weight_scale": tensorfile.Tensor("BF16", np.zeros((V, 1), np.uint16))})
    scaled = checkpoint(tmp_path / "scaled", {
        "lm_head.weight": tensorfile.Tensor("F8_E4M3", np.zeros((V, H), np.uint8)),
        "lm_head.weight_scale_inv": tensorfile.Tensor("F32", np.ones((3, 1), np.float32))})

    # Then the tied one proves with the embedding; the others are refused, saying why
    assert proof.open_lm_head(tied, H).name == "model.embed_tokens.weight"
    with pytest.raises(proof.ProofUnavailable, match="does not tie"):
        proof.open_lm_head(untied, H)
    for path in (packed, scaled):
        with pytest.raises(proof.ProofUnavailable, match="quantized"):
            proof.open_lm_head(path, H)
    # And Kimi-K2.5's multimodal names and an MTP block's head are told apart
    assert proof.pick_lm_head(["language_model.lm_head.weight", "model.mtp.0.lm_head.weight",
                               "language_model.model.norm.weight"], False) \
        == "language_model.lm_head.weight"


def test_rows_read_from_a_dump_are_its_bf16_or_dequantized_fp8_rows(tmp_path: Path) -> None:
    # Given a bf16 dump and an fp8 one (block scales) of the same 6 rows
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (6, 256)).astype(np.float32)
    bf16 = tmp_path / "b.safetensors"
    tensorfile.write(bf16, {T_HIDDEN: tensorfile.Tensor("BF16", bf16_bits(x))}, {})
    q = rng.integers(0, 0x7E, (6, 256)).astype(np.uint8)
    scales = rng.uniform(0.5, 2, (6, 2)).astype(np.float32)
    fp8 = tmp_path / "f.safetensors"
    tensorfile.write(fp8, {T_HIDDEN: tensorfile.Tensor("F8_E4M3", q),
                           T_HIDDEN_SCALE: tensorfile.Tensor("F32", scales)}, {})
    rows = np.array([1, 4])

    # When rows 1 and 4 are read from each
    with open(bf16, "rb") as f:
        got_bf16 = proof.read_rows(f.fileno(), tensorfile.read_header_fd(f.fileno(), "b"), rows)
    with open(fp8, "rb") as f:
        got_fp8 = proof.read_rows(f.fileno(), tensorfile.read_header_fd(f.fileno(), "f"), rows)

    # Then they are those rows' values
    np.testing.assert_array_equal(got_bf16, widen(bf16_bits(x))[rows])
    want = E4M3_VALUES[q[rows]].reshape(2, 2, 128) * scales[rows][:, :, None]
    np.testing.assert_array_equal(got_fp8, want.reshape(2, 256))


def test_each_engines_answer_gives_the_prompt_logprobs() -> None:
    ids = [7, 8, 9]
    # SGLang 0.5.23: meta_info.input_token_logprobs, [logprob, id, text] from position 0
    sglang = {"meta_info": {"input_token_logprobs": [[None, 7, None], [-1.5, 8, None],
                                                     [-0.25, 9, None]]}}
    # vLLM 0.32: choices[0].prompt_logprobs, {id: {"logprob", "rank", "decoded_token"}}
    vllm = {"choices": [{"prompt_logprobs": [None, {"8": {"logprob": -1.5, "rank": 3}},
                                             {"9": {"logprob": -0.25, "rank": 1}}]}]}
    assert engines.prompt_logprobs(engines.SGLANG, sglang, ids) == [None, -1.5, -0.25]
    assert engines.prompt_logprobs(engines.VLLM, vllm, ids) == [None, -1.5, -0.25]
    # And an answer without them, or for other tokens, says so
    with pytest.raises(ValueError, match="no prompt logprobs"):
        engines.prompt_logprobs(engines.SGLANG, {"meta_info": {}}, ids)
    with pytest.raises(ValueError, match="the request's is 9"):
        engines.prompt_logprobs(engines.SGLANG, {"meta_info": {"input_token_logprobs": [
            [None, 7, None], [-1.5, 8, None], [-0.25, 10, None]]}}, ids)
    with pytest.raises(ValueError, match="2 prompt logprobs for 3"):
        engines.prompt_logprobs(engines.VLLM, {"choices": [{"prompt_logprobs": [None, {}]}]},
                                ids)
