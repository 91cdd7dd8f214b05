"""The reference server over real HTTP: SGLang-like errors, batching, chunked prefill."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, dump_path
from engine_dump.rids import make_rid
from producer.localfarm.farm import LocalFarm
from tests.conftest import CACHE, EXAMPLES


def _http(port: int, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[
        tuple[LocalFarm, LocalFarm]]:
    """Two servers on the same model: chunked prefill of 64 tokens, and no chunking.

    They compute in float64 so that "identical" can be checked bit for bit after the cast to
    bf16: in float32, a different split of the same sum can flip a bf16 rounding.
    """
    base = tmp_path_factory.mktemp("servers")
    chunked = LocalFarm(base / "chunked", cache_dir=CACHE, chunked_prefill_size=64)
    whole = LocalFarm(base / "whole", cache_dir=CACHE, chunked_prefill_size=-1)
    try:
        chunked.start_server(["--dtype", "float64"])
        whole.start_server(["--dtype", "float64"])
        yield chunked, whole
    finally:
        chunked.close()
        whole.close()


def _ids(tokenizer: Any, n_samples: int) -> list[list[int]]:
    samples = json.loads(EXAMPLES.read_text())[:n_samples]
    out = []
    for s in samples:
        msgs = s.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}.get(
            m["from"], m["from"]), "content": m["value"]} for m in s["conversations"]]
        out.append(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))
    return out


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"rid": "x", "input_ids": [1, 2], "text": "a"}, 400, "Either text or input_ids"),
    ({"rid": "x"}, 400, "Either text or input_ids"),
    ({"rid": "x", "input_ids": [1, 99999]}, 400, "out of vocabulary range"),
    ({"rid": "x", "input_ids": []}, 400, "non-empty list"),
    ({"rid": "x", "input_ids": ["a"]}, 400, "non-empty list"),
    ({"rid": "x", "input_ids": [1] * 40000}, 400, "longer than the model's context length"),
    ({"rid": "x", "input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, 400,
     "max_new_tokens must be at least 0"),
    ({"rid": "x", "input_ids": [1], "sampling_params": {"temperature": -0.5}}, 400,
     "temperature must be non-negative"),
    ({"rid": "x", "input_ids": [1], "sampling_params": {"top_p": 0}}, 400,
     "top_p must be in (0, 1]"),
    ({"rid": "x", "input_ids": [1], "sampling_params": {"top_k": 0}}, 400,
     "top_k must be -1"),
    ({"rid": "x", "input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 10**6}}, 400,
     "Requested token count exceeds the model's maximum context length"),
    ({"rid": ["a", "b"], "input_ids": [1]}, 400, "rid must be a string"),
    ([1, 2], 400, "must be a JSON object"),
])
def test_bad_requests_get_sglang_like_400s(servers: tuple[LocalFarm, LocalFarm], body: Any,
                                           status: int, message: str) -> None:
    code, answer = _http(servers[0].server_port, "/generate", body)
    assert code == status
    assert message in answer["error"]["message"]


def test_invalid_json_body(servers: tuple[LocalFarm, LocalFarm]) -> None:
    code, answer = _http(servers[0].server_port, "/generate", raw=b"{not json")
    assert code == 400 and "invalid JSON" in answer["error"]["message"]


def test_info_endpoints_and_health(servers: tuple[LocalFarm, LocalFarm]) -> None:
    farm = servers[0]
    code, info = _http(farm.server_port, "/model_info")
    assert code == 200 and Path(info["model_path"]).is_dir() and info["tokenizer_path"]
    assert _http(farm.server_port, "/get_model_info")[1] == info
    code, sinfo = _http(farm.server_port, "/server_info")
    assert sinfo["chunked_prefill_size"] == 64 and sinfo["hsfarm"]["layers_to_capture"] == [2, 4, 5]
    before = set(farm.dump_dir.iterdir())
    assert _http(farm.server_port, "/health")[0] == 200
    assert _http(farm.server_port, "/health_generate")[0] == 200
    # the health check ran a real forward pass with its HEALTH_CHECK rid: nothing dumped
    assert set(farm.dump_dir.iterdir()) == before
    marker = json.loads(next(farm.dump_dir.glob(".ready.*")).read_text())
    assert marker["layers_to_capture"] == [2, 4, 5] and marker["pid"] > 0


def test_text_requests_work_but_are_not_ours(servers: tuple[LocalFarm, LocalFarm]) -> None:
    code, answer = _http(servers[0].server_port, "/generate",
                         {"text": "hello", "sampling_params": {"max_new_tokens": 1}})
    assert code == 200 and len(answer["output_ids"]) == 1
    assert not list(servers[0].dump_dir.glob("*.err"))


def test_chunked_prefill_output_equals_unchunked(servers: tuple[LocalFarm, LocalFarm],
                                                  tokenizer: Any, tiny_model: Path) -> None:
    # Given samples mostly longer than the 64-token chunk, sent concurrently (mixed batches)
    all_ids = _ids(tokenizer, 12)
    assert sum(len(x) > 64 for x in all_ids) >= 8
    rids = [make_rid(f"s{i}", 1, len(ids)) for i, ids in enumerate(all_ids)]

    def send(farm: LocalFarm) -> None:
        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(lambda a: _http(farm.server_port, "/generate",
                                                  {"rid": a[0], "input_ids": a[1]})[0],
                                  zip(rids, all_ids, strict=True)))
        assert codes == [200] * len(rids)

    chunked, whole = servers
    send(chunked)
    send(whole)
    # Then every dump is bit-identical with and without chunking
    _, info = _http(chunked.server_port, "/server_info")
    assert info["forward_passes"] > len(rids)  # chunking really happened
    from tests.farm.test_e2e import direct_forward

    for rid, ids in zip(rids, all_ids, strict=True):
        a = _wait_load(chunked.dump_dir, rid)
        b = _wait_load(whole.dump_dir, rid)
        assert a[T_INPUT_IDS].tolist() == ids
        for k in (T_INPUT_IDS, T_HIDDEN, T_AUX):
            assert torch.equal(a[k], b[k]), f"{rid} {k} differs with chunking"
        # and both equal a direct transformers forward within bf16 rounding
        hid, aux = direct_forward(tiny_model, ids, (2, 4, 5))
        torch.testing.assert_close(a[T_HIDDEN].float(), hid, atol=0.02, rtol=0.02)
        torch.testing.assert_close(a[T_AUX].float(), aux, atol=0.02, rtol=0.02)


def _wait_load(d: Path, rid: str) -> dict[str, torch.Tensor]:
    from producer.localfarm.farm import wait_until

    wait_until(lambda: dump_path(d, rid).exists(), 10, rid)
    return load_file(str(dump_path(d, rid)))


def test_aborted_requests_do_not_strand_the_others(servers: tuple[LocalFarm, LocalFarm],
                                                   tokenizer: Any) -> None:
    # Given several long requests waiting, some of whose clients give up (time out)
    port = servers[1].server_port
    ids = _ids(tokenizer, 12)
    long_ids = sorted(ids, key=len)[-1]

    def send(i: int, timeout_s: float) -> int:
        body = json.dumps({"rid": make_rid(f"ab{i}", 1, len(long_ids)),
                           "input_ids": long_ids}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status
        except (TimeoutError, urllib.error.URLError):
            return 0

    # When every other client aborts right away
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: send(i, 0.01 if i % 2 else 60), range(8)))
    # Then every client that waited got its answer (none stranded behind an abort)
    assert [codes[i] for i in range(0, 8, 2)] == [200] * 4


def _decode(port: int, ids: list[int], **sampling: Any) -> dict[str, Any]:
    code, answer = _http(port, "/generate", {"rid": f"gen-{len(ids)}-{sorted(sampling.items())}",
                                             "input_ids": ids, "sampling_params": sampling})
    assert code == 200, answer
    return answer


def test_greedy_decoding_is_the_models_own_greedy_continuation(
        servers: tuple[LocalFarm, LocalFarm], tokenizer: Any, tiny_model: Path) -> None:
    """A generation of 12 tokens, one pass per token on its cache beside other requests, is
    token for token what transformers' own greedy loop over the whole sequence gives; nothing
    of it is dumped (its rid is not the farm's)."""
    from transformers import AutoModelForCausalLM

    farm = servers[0]
    prompt = _ids(tokenizer, 1)[0][:40]
    before = set(farm.dump_dir.iterdir())
    with ThreadPoolExecutor(2) as pool:  # a second request shares its passes
        other = pool.submit(_decode, servers[0].server_port, prompt[:20], max_new_tokens=5,
                            temperature=0)
        answer = _decode(farm.server_port, prompt, max_new_tokens=12, temperature=0,
                         ignore_eos=True)
        assert len(other.result()["output_ids"]) == 5
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).eval()
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert answer["output_ids"] == seq[len(prompt):]
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12
    assert answer["text"] == tokenizer.decode(seq[len(prompt):], skip_special_tokens=True)
    assert set(farm.dump_dir.iterdir()) == before


def test_a_stop_token_ends_a_generation_and_a_seed_repeats_one(
        servers: tuple[LocalFarm, LocalFarm], tokenizer: Any) -> None:
    port = servers[0].server_port
    prompt = _ids(tokenizer, 2)[1][:30]
    sampled = dict(max_new_tokens=16, temperature=1.5, top_p=0.9, top_k=50, ignore_eos=True)
    first = _decode(port, prompt, sampling_seed=7, **sampled)["output_ids"]
    assert _decode(port, prompt, sampling_seed=7, **sampled)["output_ids"] == first
    assert _decode(port, prompt, sampling_seed=8, **sampled)["output_ids"] != first
    stop = first[3]
    cut = _decode(port, prompt, sampling_seed=7, stop_token_ids=[stop], **sampled)
    at = first.index(stop)
    assert cut["output_ids"] == first[: at + 1]  # the stop token itself is output, as SGLang's
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
