"""Which engine a server is, from its answers, and the request each engine gets for a sample."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_dump import engines
from engine_dump import markers as mk
from engine_dump.dumpfile import READY_PREFIX
from engine_dump.markers import write_ready_marker
from engine_dump.rids import make_rid

# vLLM 0.32's /v1/models for `--model /models/kimi --served-model-name kimi`
VLLM_MODELS = {"object": "list", "data": [{
    "id": "kimi", "object": "model", "created": 1, "owned_by": "vllm", "root": "/models/kimi",
    "parent": None, "max_model_len": 32768, "permission": []}]}


def test_each_engine_gets_its_own_request_for_the_same_sample() -> None:
    # Given one sample's rid and ids, and each engine as the server describes itself
    rid = make_rid("k1", 1, 3, run="0123456789abcdef")
    sglang = engines.sglang_engine({"model_path": "/models/kimi"}, "0.5.23")
    vllm = engines.vllm_engine(VLLM_MODELS, "0.32.0")
    assert vllm is not None

    # When each builds the request, unpinned and pinned to DP group 1
    s_path, s_body, s_headers = sglang.generate(rid, [5, 6, 7], None)
    v_path, v_body, v_headers = vllm.generate(rid, [5, 6, 7], 1)

    # Then SGLang decodes nothing and takes the rid in the body
    assert (s_path, s_headers) == ("/generate", {})
    assert s_body == {"rid": rid, "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}}
    assert sglang.generate(rid, [5], 2)[1]["routed_dp_rank"] == 2
    # And vLLM decodes the one token it must, and hands the rid to the hook through
    # kv_transfer_params (its own request id gets a random suffix); no model name: its base
    # model, whatever a restart named it
    assert v_path == "/v1/completions"
    assert v_body == {"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0,
                      "kv_transfer_params": {"hsfarm_rid": rid}}
    assert v_headers == {"X-Request-Id": rid, "X-data-parallel-rank": "1"}
    assert (vllm.model_path, vllm.max_model_len) == ("/models/kimi", 32768)
    assert (vllm.liveness_path, vllm.health_path) == ("/v1/models", "/health")
    assert (sglang.liveness_path, sglang.health_path) == ("/model_info", "/health_generate")


@pytest.mark.parametrize("models", [
    {"object": "list", "data": []},
    {"object": "list", "data": [{"id": "m", "root": "m"}]},  # another OpenAI server
    {"data": [{"id": "m", "max_model_len": True}]},
    ["not", "a", "dict"],
])
def test_an_answer_that_is_not_vllms_is_not_taken_for_vllm(models: object) -> None:
    assert engines.vllm_engine(models, "") is None


def test_vllms_limits_come_from_models_and_its_hooks_live_marker(tmp_path: Path) -> None:
    # Given a vLLM engine, and no marker yet
    vllm = engines.vllm_engine(VLLM_MODELS, "0.32.0")
    assert vllm is not None
    before = vllm.server_info(tmp_path)
    # Then only the context is known; the callers' defaults size the rest
    assert before == {"engine": "vllm", "version": "0.32.0", "context_length": 32768}

    # When its hook (this live process) leaves its marker, with an SGLang one beside it
    write_ready_marker(tmp_path, {"engine": "vllm", "max_num_batched_tokens": 8192,
                                  "max_num_seqs": 256, "dp_groups": 2, "max_model_len": 32768})
    (tmp_path / f"{READY_PREFIX}1").write_text(json.dumps({"max_num_batched_tokens": 1}))

    # Then the batch budget, the most requests and the DP ranks are the vLLM hook's, in
    # SGLang's names, and the DP ranks are the groups a probe and admission pin to
    info = vllm.server_info(tmp_path)
    assert info["chunked_prefill_size"] == 8192 and info["max_running_requests"] == 256
    assert engines.dp_groups(info) == 2
    assert vllm.server_info(None) == before


# A vLLM hook's writer: writes its marker (argv: dump dir, the marker's JSON), prints the
# words its dumps name it by (``M_WRITER``), then lives until killed
VLLM_WRITER = ("import json, sys, time; from pathlib import Path; "
               "from engine_dump import markers as mk; "
               "mk.write_ready_marker(Path(sys.argv[1]), json.loads(sys.argv[2])); "
               "print(mk.writer_id(), flush=True); time.sleep(60)")


def test_two_vllm_servers_in_one_dump_dir_each_reads_its_own_marker(tmp_path: Path) -> None:
    # Given two live vLLM server starts writing one dump dir: A with 2 DP ranks and 64
    # requests, B (started later: the newest marker) with 1 rank and 256
    def start(info: dict[str, object]) -> tuple[subprocess.Popen[str], str]:
        p = subprocess.Popen([sys.executable, "-c", VLLM_WRITER, str(tmp_path),
                              json.dumps({"engine": "vllm", "max_num_batched_tokens": 8192,
                                          **info})], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        return p, p.stdout.readline().strip()

    procs = [start({"server_id": "A", "dp_groups": 2, "attn_dp_rank": r, "max_num_seqs": 64})
             for r in (0, 1)]
    procs.append(start({"server_id": "B", "dp_groups": 1, "attn_dp_rank": 0,
                        "max_num_seqs": 256}))
    try:
        (_, a0), (_, a1), (_, b) = procs
        vllm = engines.vllm_engine(VLLM_MODELS, "0.32.0")
        assert vllm is not None
        # When each reads the markers of the server its probe's dump names (either rank of A)
        # Then each gets its own server's DP ranks and limits
        for writer in (a0, a1):
            info = vllm.server_info(tmp_path, writer)
            assert engines.dp_groups(info) == 2 and info["max_running_requests"] == 64
        info = vllm.server_info(tmp_path, b)
        assert engines.dp_groups(info) == 1 and info["max_running_requests"] == 256
        # And with nothing naming the server, the shared dir is refused, naming both
        with pytest.raises(mk.SharedDumpDir, match=r"2 servers write into this dump dir: "
                           r"server A .*; server B "):
            vllm.server_info(tmp_path)
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()


def test_a_generation_goes_to_each_engines_own_api_and_neither_hook_dumps_it() -> None:
    sglang = engines.sglang_engine({"model_path": "/models/kimi"}, "0.5.23")
    vllm = engines.vllm_engine(VLLM_MODELS, "0.32.0")
    assert vllm is not None
    sampling = engines.Sampling(256, 0.7, 0.95, 40, (7,), seed=1234)
    s_path, s_body, _ = sglang.decode("hsgen-x-t0-r1", [5, 6], sampling, 1)
    assert s_path == "/generate" and s_body == {
        "rid": "hsgen-x-t0-r1", "input_ids": [5, 6], "routed_dp_rank": 1,
        "sampling_params": {"max_new_tokens": 256, "temperature": 0.7, "top_p": 0.95,
                            "top_k": 40, "stop_token_ids": [7], "sampling_seed": 1234}}
    v_path, v_body, v_headers = vllm.decode("hsgen-x-t0-r1", [5, 6], sampling, None)
    assert v_path == "/v1/completions" and v_headers == {"X-Request-Id": "hsgen-x-t0-r1"}
    assert v_body == {"prompt": [5, 6], "max_tokens": 256, "temperature": 0.7, "top_p": 0.95,
                      "top_k": 40, "seed": 1234, "stop_token_ids": [7],
                      "return_token_ids": True}
    assert engines.VLLM_KV_PARAMS not in v_body  # the vLLM hook dumps only what carries it
    # each engine's answer, as it gives it: the output's ids, why it ended, the stop token
    said = sglang.decoded({"text": "hi", "output_ids": [8, 9, 2], "meta_info": {
        "prompt_tokens": 2, "finish_reason": {"type": "stop", "matched": 2}}})
    assert said == engines.Decoded([8, 9, 2], engines.FINISH_STOP, 2, 2)
    cut = vllm.decoded({"choices": [{"text": "hi", "token_ids": [8, 9], "finish_reason": "length",
                                     "stop_reason": None}], "usage": {"prompt_tokens": 2}})
    assert cut == engines.Decoded([8, 9], engines.FINISH_LENGTH, None, 2)
    with pytest.raises(ValueError, match="neither stop nor length"):
        sglang.decoded({"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort"}}})
    with pytest.raises(ValueError, match="no output token ids"):
        vllm.decoded({"choices": [{"text": "hi", "finish_reason": "stop"}]})
