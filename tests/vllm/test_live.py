"""The hsfarm connector inside live vLLM servers: its dumps against transformers, float32.

Dumps store bf16 (or fp8), so each value is compared with transformers' float32 value rounded
the same way: a capture that equals transformers leaves nearly every value equal, and each
token within bf16's own rounding. ``hidden_state`` is compared with transformers'
post-norm state and shown far from its pre-norm one. The tests on ``plain`` come first: the
``chunked`` fixture stops that server before it starts its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_dump import engines
from engine_dump import fp8 as codec
from engine_dump.checkpoint import weights_identity
from engine_dump.dumpfile import (
    DTYPE_BF16,
    DTYPE_FP8,
    M_DUMP_DTYPE,
    M_LAYERS,
    M_RID,
    M_SERVER_VERSION,
    M_WEIGHTS,
    PATCH_VERSION,
    READY_PREFIX,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    dump_path,
    err_path,
)
from engine_dump.rids import INTERNAL_KEY_PREFIX, NO_RUN, RID_PREFIX, make_rid
from tests.vllm.conftest import measured
from tests.vllm.live import AUX_IDS, LAST_ID, LiveVllm, prompt, send_all, vocab, wait_dump
from tests.vllm.reference import Errors, dump_of, load_file_metadata, reference, rel_errors
from vllm_hook.layout import ENV_DUMP_DIR, RID_PARAM
from worker.core import fp8 as farm_fp8

FP8_TOLERANCE = 0.05  # per token and layer, as for SGLang's fp8 dumps (tests/live)


# --- plain: the default scheduler, bf16 -------------------------------------------------------

def test_unchunked_values_match_transformers(plain: LiveVllm) -> None:
    # Given prompts of 40, 200 and 500 tokens sent one after the other
    errors = Errors("unchunked (one step each)")
    for i, n in enumerate((40, 200, 500)):
        ids = prompt(n, i, vocab(plain.model))
        rid = make_rid(f"u{i}", 1, n)
        answer = plain.complete(ids, rid)
        # Then vLLM answers with the rid, and the dump is transformers' states
        assert answer["kv_transfer_params"] == {RID_PARAM: rid}
        dump = dump_of(plain, rid)
        errors.add(dump, ids, plain.model)
    errors.report()


def test_dumps_say_what_served_them(plain: LiveVllm) -> None:
    n = 30
    rid = make_rid("meta", 1, n)
    plain.complete(prompt(n, 99, vocab(plain.model)), rid)
    meta = load_file_metadata(wait_dump(plain.dumps, rid))
    weights = json.loads(meta[M_WEIGHTS])
    assert json.loads(meta[M_LAYERS]) == AUX_IDS
    assert meta[M_RID] == rid and meta[M_DUMP_DTYPE] == DTYPE_BF16
    assert meta[M_SERVER_VERSION].startswith("vllm-0.32.")
    assert weights["id"] == weights_identity(plain.model)["id"]
    assert weights["model_path"] == str(plain.model)


def test_concurrent_requests_match_transformers(plain: LiveVllm) -> None:
    # Given four requests of different lengths sent at once
    reqs = [(make_rid(f"c{i}", 1, n), prompt(n, 10 + i, vocab(plain.model)))
            for i, n in enumerate((100, 300, 721, 50))]
    send_all(plain, reqs)
    errors = Errors("concurrent (4 sent at once)")
    for rid, ids in reqs:
        errors.add(dump_of(plain, rid), ids, plain.model)
    errors.report()


def test_prefix_cache_hits_lose_no_rows(plain: LiveVllm) -> None:
    # Given a 300-token prompt, then one sharing its first 256 tokens, then the first again
    base = prompt(300, 20, vocab(plain.model))
    other = base[:256] + prompt(60, 21, vocab(plain.model))
    first, second, again = (make_rid(k, 1, len(ids)) for k, ids in
                            (("p0", base), ("p1", other), ("p2", base)))
    plain.complete(base, first)
    hits = [plain.complete(ids, rid)["usage"] for rid, ids in ((second, other), (again, base))]
    # Then vLLM served the shared prefix from its cache, and the dumps are whole and right
    cached = [int(u["prompt_tokens_details"]["cached_tokens"]) for u in hits]  # type: ignore[index]
    assert min(cached) >= 128, cached  # whole blocks of the shared prefix
    errors = Errors(f"prefix-cache hits ({cached[0]}, {cached[1]} cached)")
    for rid, ids in ((second, other), (again, base)):
        errors.add(dump_of(plain, rid), ids, plain.model)
    errors.report()
    a, b = dump_of(plain, first), dump_of(plain, again)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_requests_not_ours_write_nothing(plain: LiveVllm) -> None:
    # Given a request without kv_transfer_params, one whose rid is not a farm rid, and one
    # of ours after them
    before = set(os.listdir(plain.dumps))
    ids = prompt(50, 30, vocab(plain.model))
    for params in (None, {RID_PARAM: "cmpl-somebody-else"}):
        assert not plain.complete(ids, None, params).get("kv_transfer_params")
    rid = make_rid("after", 1, len(ids))
    plain.complete(ids, rid)
    wait_dump(plain.dumps, rid)
    time.sleep(1)
    # Then only ours is in the dump dir
    assert set(os.listdir(plain.dumps)) - before == {f"{rid}.safetensors"}


def test_a_regenerated_turn_goes_through_vllms_own_api_and_dumps_nothing(
        plain: LiveVllm) -> None:
    """What a regenerating farm sends (``Engine.decode``) and reads back (``Engine.decoded``):
    the output's token ids and why it ended; the hook dumps none of it."""
    with urllib.request.urlopen(f"{plain.url}/v1/models", timeout=60) as r:
        engine = engines.vllm_engine(json.loads(r.read()), "0.32.0")
    assert engine is not None
    before = set(os.listdir(plain.dumps))
    ids = prompt(60, 41, vocab(plain.model))
    answers = []
    for n, seed in enumerate((7, 7, 8)):
        path, body, headers = engine.decode(f"hsgen-{n}", ids,
                                            engines.Sampling(12, 1.0, 1.0, -1, (), seed), None)
        req = urllib.request.Request(f"{plain.url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **headers})
        with urllib.request.urlopen(req, timeout=300) as r:
            answers.append(engine.decoded(json.loads(r.read())))
    for out in answers:
        assert 1 <= len(out.output_ids) <= 12 and out.prompt_tokens == len(ids)
        assert out.finish in (engines.FINISH_STOP, engines.FINISH_LENGTH)
        assert out.finish == engines.FINISH_STOP or len(out.output_ids) == 12
    # vLLM takes the seed, but its draws are only as repeatable as its numerics: the second
    # request hits the prefix cache, and at temperature 1 a bf16 difference flips a draw
    first, again, _ = answers
    same = next((i for i, (a, b) in enumerate(zip(first.output_ids, again.output_ids,
                                                  strict=False)) if a != b),
                min(len(first.output_ids), len(again.output_ids)))
    measured(f"a generation asked twice with one seed: the first {same} of "
             f"{len(first.output_ids)} tokens the same")
    time.sleep(1)
    assert set(os.listdir(plain.dumps)) == before


def test_a_prompt_other_than_its_rid_declares_is_an_err(plain: LiveVllm) -> None:
    # Given a request of ours whose prompt is one token longer than its rid says
    ids = prompt(21, 31, vocab(plain.model))
    rid = make_rid("longer", 1, 20)
    plain.complete(ids, rid)
    # Then its .err says why, and no dump or temp file is left
    err = err_path(plain.dumps, rid)
    deadline = time.monotonic() + 60
    while not err.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "21 token ids, 21 hidden and 21 aux rows; the rid declares 20" in err.read_text()
    assert not [p for p in os.listdir(plain.dumps) if rid in p and not p.endswith(".err")]


def test_ready_marker_says_what_the_hook_serves(plain: LiveVllm) -> None:
    markers = list(plain.dumps.glob(f"{READY_PREFIX}*"))
    assert len(markers) == 1  # TP 1: one writing worker
    info = json.loads(markers[0].read_text())
    assert info["engine"] == "vllm" and info["vllm_version"].startswith("0.32.")
    assert info["server_version"] == f"vllm-{info['vllm_version']}"
    assert info["layers_to_capture"] == AUX_IDS and info["hidden_state_of_id"] == LAST_ID
    assert info["hidden_size"] == 128 and info["tp_size"] == 1
    assert info["dump_dtype"] == DTYPE_BF16
    assert info["model_path"] == str(plain.model)
    assert info["model_config_sha256"] == hashlib.sha256(
        (plain.model / "config.json").read_bytes()).hexdigest()
    assert info["weights"]["id"] == weights_identity(plain.model)["id"]
    assert info["patch_version"] == PATCH_VERSION
    assert Path(f"/proc/{info['pid']}").exists()
    assert "hsfarm dump hook active: aux ids [2, 3, 5]" in plain.log.read_text(errors="replace")
    # And verify finds it, as a launcher polls for it
    proc = subprocess.run([sys.executable, "-m", "vllm_hook", "verify", "--live-only",
                           "--dump-dir", str(plain.dumps)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("PASS  ready marker: pid "), \
        proc.stdout + proc.stderr


def test_a_rid_too_long_for_a_file_name_stalls_nothing(plain: LiveVllm) -> None:
    # Given a request whose rid looks like ours but carries a 300-character sample key (the
    # last test on ``plain``: a writer that dies on it leaves the server hung)
    v = vocab(plain.model)
    n = 40
    too_long = f"{RID_PREFIX}{NO_RUN}-{'k' * 300}-a1-n{n}"
    # When the server serves it, then eight requests of ours, one after the other
    answer = plain.complete(prompt(n, 60, v), too_long)
    t0 = time.monotonic()
    for i in range(8):
        rid = make_rid(f"after-{i}", 1, n)
        plain.complete(prompt(n, 61 + i, v), rid)
        # Then each gets its dump: the writer lives on, and no step waits on it
        wait_dump(plain.dumps, rid, timeout_s=60)
    measured(f"8 requests after a 300-character key: all dumped in {time.monotonic() - t0:.1f}s")
    # And the long rid was served as a request not ours: nothing of it was written
    assert not answer.get("kv_transfer_params")
    assert not [p for p in os.listdir(plain.dumps) if "kkkk" in p]


# --- chunked: 64 tokens a step, fp8 -----------------------------------------------------------

def test_chunked_values_match_transformers(chunked: LiveVllm) -> None:
    # Given the farm's own requests (bf16 on an fp8 server) of 300 tokens (five chunks), then
    # 194 and 291 at once (their chunks interleaved), then 291 again with a new tail
    v = vocab(chunked.model)
    own = INTERNAL_KEY_PREFIX
    one = (make_rid(f"{own}k0", 1, 300), prompt(300, 40, v))
    pair = [(make_rid(f"{own}k{i}", 1, n), prompt(n, 40 + i, v))
            for i, n in ((1, 194), (2, 291))]
    tail = pair[1][1][:256] + prompt(35, 43, v)
    hit = (make_rid(f"{own}k3", 1, len(tail)), tail)
    chunked.complete(one[1], one[0])
    send_all(chunked, pair)
    usage = chunked.complete(hit[1], hit[0])["usage"]
    cached = int(usage["prompt_tokens_details"]["cached_tokens"])  # type: ignore[index]
    assert cached >= 128
    errors = Errors(f"chunked (64 a step; {cached} cached)")
    for rid, ids in [one, *pair, hit]:
        dump = dump_of(chunked, rid)
        assert dump[T_AUX].dtype == torch.bfloat16
        errors.add(dump, ids, chunked.model)
    errors.report()


def test_fp8_dumps_read_back_within_e4m3s_rounding(chunked: LiveVllm) -> None:
    # Given prompts sent twice: as samples (fp8) and as the farm's own requests (bf16)
    v = vocab(chunked.model)
    reqs = []
    for i, n in enumerate((35, 142, 300)):
        ids = prompt(n, 50 + i, v)
        reqs += [(make_rid(f"f{i}", 1, n), ids),
                 (make_rid(f"{INTERNAL_KEY_PREFIX}f{i}", 1, n), ids)]
    send_all(chunked, reqs)
    worst_bf16 = worst_hf = 0.0
    for (sample, ids), (own, _) in zip(reqs[::2], reqs[1::2], strict=True):
        got, ref = dump_of(chunked, sample), dump_of(chunked, own)
        n = len(ids)
        post, _, inputs = reference(chunked.model, ids, AUX_IDS)
        hf = {T_HIDDEN: post, T_AUX: torch.cat(inputs, dim=1)}
        # Then the sample's dump is e4m3 with one scale per block of 128 (H = 128) per layer
        assert got[T_AUX].dtype == torch.float8_e4m3fn
        assert got[T_HIDDEN_SCALE].shape == (n, 1) and got[T_AUX_SCALE].shape == (n, 3)
        assert load_file_metadata(dump_path(chunked.dumps, sample))[M_DUMP_DTYPE] == \
            DTYPE_FP8
        for name, scale, layers in ((T_HIDDEN, T_HIDDEN_SCALE, 1),
                                    (T_AUX, T_AUX_SCALE, 3)):
            q, s = got[name].view(torch.uint8), got[scale]
            back = codec.dequantize(q, s, torch.float32, layers=layers)
            # And the farm's numpy reader reads the hook's values bit for bit
            np_back = farm_fp8.dequantize(q.numpy(), s.numpy(), layers=layers)
            assert np.array_equal(np_back.view(np.uint32), back.numpy().view(np.uint32))
            for want, worst in ((ref[name], "bf16"), (hf[name], "hf")):
                w = want.float().view(n, layers, -1)
                err = float(rel_errors(back.view(n, layers, -1), w).max())
                if worst == "bf16":
                    worst_bf16 = max(worst_bf16, err)
                else:
                    worst_hf = max(worst_hf, err)
    measured(f"{'fp8 e4m3 (blocks of 128)':<36} vs bf16 dumps of the same prompts: max "
             f"{worst_bf16:.2e}; vs transformers float32: max {worst_hf:.2e}")
    assert worst_bf16 < FP8_TOLERANCE and worst_hf < FP8_TOLERANCE


def test_a_launch_without_the_dump_dir_is_refused_with_the_fix(
        chunked: LiveVllm, tmp_path: Path) -> None:
    # Given a server launched with the connector but without its dump dir (the last test:
    # it stops ``chunked`` first)
    chunked.stop()
    server = LiveVllm(chunked.model, tmp_path / "dumps", tmp_path / "server.log",
                      env={ENV_DUMP_DIR: ""})
    # When it starts, then it exits, naming the variable to set
    try:
        with pytest.raises(RuntimeError, match="exited") as e:
            server.start()
    finally:
        server.stop()  # its whole process group, whatever happened
    assert f"set {ENV_DUMP_DIR}" in server.log.read_text(errors="replace"), str(e.value)
    assert not (tmp_path / "dumps").exists()


def test_pipeline_parallelism_is_refused_by_vllm_itself(chunked: LiveVllm,
                                                        tmp_path: Path) -> None:
    # Given a server launched with two pipeline stages, for a model that declares aux states
    # across stages (Llama: supports_aux_hidden_states_over_pp)
    chunked.stop()
    server = LiveVllm(chunked.model, tmp_path / "dumps", tmp_path / "server.log",
                      extra=["--pipeline-parallel-size", "2"])
    # When it starts, then vLLM 0.32 refuses the launch before any hook runs: the drafter of
    # extract_hidden_states does not implement SupportsPP (config/speculative.py), so no
    # model runs it under pipeline parallelism; the hook's own refusal (layout_problems) stays
    # for a release that lifts this
    try:
        with pytest.raises(RuntimeError, match="exited") as e:
            server.start()
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    assert "Pipeline parallelism is not supported for this model" in log, str(e.value)
    assert not list((tmp_path / "dumps").glob(".ready.*"))
