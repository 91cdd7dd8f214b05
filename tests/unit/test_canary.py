"""The canary's parts in one process: a recording written once and read back, a damaged one
refused, a small mismatch named a change of numerics and a large one not, rows that include the
chunk boundary. No server, Redis or worker.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine_dump.dumpfile import TMP_MARK
from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE
from worker.core import canary as cn
from worker.core.errors import ConfigError
from worker.core.samples import Sample
from worker.server.canary_check import CanaryCheck, chat_encoder
from worker.server.chat import ChatTokenizer
from worker.server.fingerprint import compute_fingerprint

# --- the recording and the comparison, without services --------------------------------------

def _canaries(seed: int) -> list[cn.Canary]:
    rng = np.random.default_rng(seed)
    return [cn.Canary(np.arange(n, dtype=np.int64), cn.sample_rows(n, 64),
                      cn.from_bf16(cn._to_bf16(rng.normal(size=(4, len(cn.sample_rows(n, 64)),
                                                                 16)).astype(np.float32))))
            for n in (10, 200)]


def test_recording_is_written_once_and_read_back(tmp_path: Path) -> None:
    # Given two workers recording at once (other values each)
    mine, theirs = _canaries(0), _canaries(1)
    assert cn.record(tmp_path, mine, {"who": "first"})
    # Then only the first recording stands; the second is told so
    assert not cn.record(tmp_path, theirs, {"who": "second"})
    got, meta = cn.load(tmp_path)
    assert meta["who"] == "first" and not list(tmp_path.glob(f"*{TMP_MARK}*"))
    for a, b in zip(got, mine, strict=True):
        assert np.array_equal(a.states, b.states) and np.array_equal(a.rows, b.rows)
    # And comparing it with itself passes with zero error, with the other fails
    names = cn.layer_names((2, 4, 5))
    assert cn.compare(got, [m.states for m in mine], names, 1e-9, 1e-9).passed
    bad = cn.compare(got, [t.states for t in theirs], names, 0.05, 0.01)
    assert not bad.passed and all(e.mean_rel > 0.5 for e in bad.layers)
    assert "<-- differs" in bad.table() and "final" in bad.table()


def test_damaged_recording_is_refused(tmp_path: Path) -> None:
    cn.record(tmp_path, _canaries(0), {})
    path = cn.path_in(tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="is damaged"):
        cn.load(tmp_path)


def test_a_small_mismatch_names_a_change_of_numerics_a_large_one_does_not(
        tmp_path: Path, tiny_model: Path) -> None:
    settings = LocalFarm(tmp_path / "farm", cache_dir=CACHE).settings()
    check = CanaryCheck(settings, settings.output_dir, tiny_model,
                        compute_fingerprint(settings, tiny_model), "w", encode=lambda t: [])
    names = cn.layer_names((2, 4, 5))

    def text(max_rel: float) -> str:
        cmp = cn.Comparison([cn.LayerError(n, max_rel, max_rel / 2) for n in names], [],
                            0.01, 0.0025)
        return check._mismatch_text(cmp, {"recorded_at": "0", cn.M_WEIGHTS_ID: "ab12"})

    # Another checkpoint (measured: ~166%): restore the model or start a new output dir
    large = text(1.66)
    assert "Two ways on:" in large and "FARM_CANARY_MAX_REL_ERR" not in large
    # A few percent (another quantisation, or numerics: TP size, kernels): a third way
    small = text(0.03)
    assert "Three ways on:" in small and "FARM_CANARY_MAX_REL_ERR" in small
    assert "restore the server's model" in small and "FARM_OUTPUT_DIR" in small


def test_the_prompts_are_tokenized_as_samples_are(tiny_model: Path) -> None:
    # Given the run's tokenizer, as a worker loads it
    chat = ChatTokenizer.from_pretrained(str(tiny_model), 8192, "truncate")
    tok = chat.tok
    # When the canary's prompts are tokenized as the worker tokenizes them
    prompts = cn.prompt_ids(chat_encoder(chat), 256, 8192)
    # Then each starts with BOS and the template's header tokens, has the system prompt and,
    # where not cut, the assistant's turn, just as a sample of the same conversation
    header = tok.convert_tokens_to_ids("<|start_header_id|>")
    for ids, conversation in zip(prompts, cn.prompt_conversations(), strict=True):
        assert ids[:2] == [tok.bos_token_id, header], ids[:8]
        assert "system" in tok.decode(ids[:8])
        rendered = tok.apply_chat_template(conversation, tokenize=False)
        assert ids == tok(rendered, add_special_tokens=False)["input_ids"][: len(ids)]
    for ids, conversation in zip(prompts[:2], cn.prompt_conversations(), strict=False):
        assert ids == chat.encode(Sample("s", messages=tuple(conversation))).input_ids
    assert tok.decode(prompts[0]).endswith(cn.ANSWER + "<|eot_id|>")
    assert len(prompts[2]) == cn.long_tokens(256, 8192)


def test_a_template_without_a_system_turn_gets_the_conversation_without_it(
        tiny_model: Path) -> None:
    # Given a template that refuses a system turn (as some do)
    chat = ChatTokenizer.from_pretrained(str(tiny_model), 8192, "reject")
    chat.tok.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                              "{{ raise_exception('no system role') }}{% endif %}"
                              + chat.tok.chat_template)
    # Then the canary's prompts are its user and assistant turns, still after BOS
    prompts = cn.prompt_ids(chat_encoder(chat), 256, 8192)
    assert all(p[0] == chat.tok.bos_token_id for p in prompts)
    assert "system" not in chat.tok.decode(prompts[0])
    # And a template that refuses every conversation of the canary stops the worker
    chat.tok.chat_template = "{{ raise_exception('no') }}"
    with pytest.raises(ConfigError, match="refuses the canary's conversation"):
        chat_encoder(chat)(cn.prompt_conversations()[0])


def test_rows_include_the_chunk_boundary() -> None:
    rows = cn.sample_rows(320, 256).tolist()
    assert {0, 255, 256, 319} <= set(rows) and rows == sorted(set(rows))
    assert cn.long_tokens(256, 8192) == 320 and cn.long_tokens(-1, 8192) == 1024


# --- the farm --------------------------------------------------------------------------------
