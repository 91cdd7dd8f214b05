"""The plugin inside real SGLang 0.5.23: loader, targets, layout checks, capture, verify."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine_dump.checkpoint import weights_identity
from engine_dump.dumpfile import M_WEIGHTS, T_AUX, T_HIDDEN, T_INPUT_IDS, dump_path, err_path
from engine_dump.rids import make_rid
from sglang_patch import plugin, verify

H, V = 16, 50
ROOT = Path(__file__).resolve().parents[2]


def test_version_targets_and_flags_are_what_we_expect() -> None:
    # The hook targets exist with the parameters the wrappers are written against, and the
    # launch flags parse with SGLang's own parser.
    for check in (verify.check_version, verify.check_targets, verify.check_flags):
        result = check()
        assert result.ok, result.line()


_PROBE = """
import sys
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.layers.logits_processor import LogitsProcessor
load_plugins()
ours = sorted(t for t, hooks in HookRegistry._hooks.items()
              if any(h.__module__ == "sglang_patch.plugin" for _, h, _ in hooks))
wrapped = hasattr(LogitsProcessor.forward, "__wrapped__")
print(ours, wrapped, "sglang_patch.sglang_hook" in sys.modules)
"""


@pytest.mark.parametrize("dump_dir", ["", "/tmp/hsfarm-test-dumps"])
def test_sglang_loader_installs_plugin_only_with_variable(dump_dir: str) -> None:
    # Given a fresh process, as SGLang spawns its schedulers
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_HS_DUMP_DIR"}
    if dump_dir:
        env["SGLANG_HS_DUMP_DIR"] = dump_dir
    # When SGLang's own plugin loader runs
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.strip().splitlines()[-1]
    # Then our hooks are applied only when the variable is set, and cost nothing otherwise
    if dump_dir:
        assert out == (f"{sorted([plugin.TARGET_LOAD, plugin.TARGET_ATTN, plugin.TARGET_LOGITS])}"
                       " True False")
    else:
        assert out == "[] False False"


def _server_args(**overrides: Any) -> Any:
    """A real ServerArgs, resolved on CPU, launched as the README says (plus overrides)."""
    from sglang.srt.server_args import ServerArgs

    args = dict(model_path=str(ROOT / "tests"), device="cpu", disable_radix_cache=True,
                disable_prefill_cuda_graph=True, enable_return_aux_hidden_states=True,
                speculative_algorithm="EAGLE3")
    args.update(overrides)
    return ServerArgs(**args)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"pp_size": 2}, "--pp-size 1"),
    ({"enable_two_batch_overlap": True}, "--enable-two-batch-overlap"),
    ({"disable_prefill_cuda_graph": False}, "--disable-prefill-cuda-graph"),
    ({"disable_radix_cache": False}, "--disable-radix-cache"),
    ({"enable_return_aux_hidden_states": False}, "--enable-return-aux-hidden-states"),
    ({"enable_layernorm_sp": True}, "--enable-layernorm-sp"),
])
def test_load_hook_refuses_layouts_it_cannot_handle(plugins_loaded: Path,
                                                    overrides: dict[str, Any],
                                                    message: str) -> None:
    # Through the real, patched ModelRunner.load_model: the check runs before the original
    # (which needs a GPU, so a runner object stands in for ModelRunner's state).
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = SimpleNamespace(server_args=_server_args(**overrides))
    with pytest.raises(plugin.LayoutError, match=message):
        ModelRunner.load_model(runner)


def test_load_hook_refuses_an_unknown_dump_dtype(plugins_loaded: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A misspelt SGLANG_HS_DUMP_DTYPE stops the server before the weights load, with the fix
    from sglang.srt.model_executor.model_runner import ModelRunner

    monkeypatch.setenv("SGLANG_HS_DUMP_DTYPE", "fp8")
    runner = SimpleNamespace(server_args=_server_args())
    with pytest.raises(plugin.LayoutError, match="SGLANG_HS_DUMP_DTYPE='fp8': set it to one "
                                                 "of bfloat16, fp8_e4m3"):
        ModelRunner.load_model(runner)


def test_markers_count_the_dp_groups_in_both_of_sglangs_spellings() -> None:
    # A real ServerArgs as each spelling leaves it (the hook reads it unresolved): 0.5.23's
    # --attn-dp-size, the deprecated --dp-size N --enable-dp-attention, and plain --dp-size
    # (whole-server replicas, each its own scheduler set: no groups of one server)
    from engine_dump.engines import dp_groups

    assert dp_groups(_server_args(tp_size=8, attn_dp_size=8)) == 8
    assert dp_groups(_server_args(tp_size=8, dp_size=8, enable_dp_attention=True)) == 8
    assert dp_groups(_server_args(tp_size=8, dp_size=2)) == 1
    assert dp_groups(_server_args(tp_size=8)) == 1


@pytest.fixture
def pending(sglang_ctx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The plugin's state after the patched load_model and init_attention_backends ran on a
    stand-in runner whose model has no capture ids yet. A stand-in, because ModelRunner cannot
    be built without a GPU, and because no live SGLang 0.5.23 server sets the ids later than
    init_attention_backends (the live tests, tests/live/, show that path): this is the
    protection against an SGLang that moves the call, or never makes it."""
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_HS_DUMP_RESERVE_BYTES", "0")
    inner = torch.nn.Module()
    inner.layers_to_capture = []
    model = torch.nn.Module()
    model.language_model = inner  # where Kimi-K2.5 keeps DeepseekV3's model
    runner = SimpleNamespace(server_args=_server_args(tp_size=8), model=model,
                             model_config=SimpleNamespace(hidden_size=H))
    plugin.around_load_model(lambda r: None, runner)
    plugin.around_init_attention_backends(lambda r: None, runner)
    yield inner
    if plugin._hook is not None:
        plugin._hook.writer.close()
    plugin._hook = plugin._activation = None


def test_ids_that_never_arrive_give_our_requests_an_err_with_the_fix(pending: Any,
                                                                    tmp_path: Path) -> None:
    # Given a model whose capture ids are still unknown after load and attention set-up
    assert plugin._hook is None and not list(tmp_path.glob(".ready.*"))
    # When a batch holds a request of ours (ending here), one of ours mid-prompt and a
    # foreign one, through the real patched LogitsProcessor.forward
    proc = _processor()
    done, mid = make_rid("done", 1, 4), make_rid("mid", 1, 9)
    out = _forward(proc, [(done, 0, 4, _request(4, 1)), (mid, 0, 3, _request(9, 2)),
                          ("chatcmpl-7", 0, 2, _request(2, 3))])
    # Then the server goes on (the LM head ran), no marker or writer exists, the finished
    # request of ours has a .err naming the fix, and nothing else was written
    assert out.next_token_logits.shape == (3, V)
    assert plugin._hook is None
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{done}.err"]
    message = err_path(tmp_path, done).read_text()
    assert "--enable-return-aux-hidden-states" in message and "verify" in message


def test_ids_that_arrive_late_bring_the_hook_up_at_the_first_request(pending: Any,
                                                                    tmp_path: Path) -> None:
    # Given ids that SGLang sets only after init_attention_backends
    pending.layers_to_capture = [2, 4, 5]
    # When the first request of ours arrives
    proc = _processor()
    rid = make_rid("late", 1, 6)
    ids, hid, aux = _request(6, 4)
    _forward(proc, [("HEALTH_CHECK_1", 0, 1, _request(1, 5)), (rid, 0, 6, (ids, hid, aux))])
    plugin._hook.writer.flush()
    # Then the hook came up there, its marker records the ids and where they were found,
    # and the request's dump is whole
    import json

    info = json.loads(next(tmp_path.glob(".ready.*")).read_text())
    assert info["layers_to_capture"] == [2, 4, 5]
    assert info["ids_known"] == "at the first request" and info["tp_size"] == 8
    got = load_file(str(dump_path(tmp_path, rid)))
    assert torch.equal(got[T_HIDDEN], hid.to(torch.bfloat16))
    assert torch.equal(got[T_AUX], aux.to(torch.bfloat16))


def test_a_wrong_number_of_ids_is_refused_at_start_and_answered_while_serving(
        pending: Any, tmp_path: Path) -> None:
    # At start-up (init_attention_backends): the launch is refused with the fix
    pending.layers_to_capture = [2, 4]
    runner = plugin._activation.runner
    with pytest.raises(plugin.LayoutError, match="--return-aux-hidden-state-layer-ids"):
        plugin.around_init_attention_backends(lambda r: None, runner)
    # While serving (ids changed after start): the request gets the reason, the server lives
    rid = make_rid("two", 1, 3)
    _forward(_processor(), [(rid, 0, 3, _request(3, 6))])
    assert "needs exactly 3" in err_path(tmp_path, rid).read_text()
    assert plugin._hook is None


def _processor() -> Any:
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=H, vocab_size=V, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2)
    return LogitsProcessor(cfg)


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(V, H))


def _request(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (n,), generator=g), torch.randn(n, H, generator=g),
            torch.randn(n, 3 * H, generator=g))


def _forward(processor: Any, parts: list[tuple[str, int, int, Any]], pad: int = 0,
             mode: str = "EXTEND") -> Any:
    """One real LogitsProcessor.forward over a real ForwardBatch laid out like SGLang's."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    rows = [[t[pre : pre + ext] for t in full] for _, pre, ext, full in parts]
    ids = torch.cat([r[0] for r in rows] + [torch.zeros(pad, dtype=torch.int64)])
    hid = torch.cat([r[1] for r in rows] + [torch.zeros(pad, H)])
    aux = torch.cat([r[2] for r in rows] + [torch.zeros(pad, 3 * H)])
    ext = [p[2] for p in parts] + ([pad] if pad else [])
    pre = [p[1] for p in parts] + ([0] if pad else [])
    fb = ForwardBatch(
        forward_mode=getattr(ForwardMode, mode), batch_size=len(parts), input_ids=ids,
        req_pool_indices=None,
        seq_lens=torch.tensor([a + b for a, b in zip(pre, ext, strict=True)]),
        out_cache_loc=None, seq_lens_sum=int(sum(pre) + sum(ext)), rids=[p[0] for p in parts],
        extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=pre,
        extend_seq_lens=torch.tensor(ext), extend_prefix_lens=torch.tensor(pre))
    fb.capture_hidden_mode = CaptureHiddenMode.NULL
    # Kimi-K2.5 passes input_ids=None to the language model: the hook reads the batch's ids
    aux_list = list(aux.split(H, dim=-1))
    return processor(None, hid, _Head(), fb, aux_list)


def test_capture_through_the_real_hook(hook: Any) -> None:
    # Given our requests mixed with a health check and a foreign client, one request chunked
    # over three batches, a retried rid, a truncated request and padding rows
    proc = _processor()
    a, b = make_rid("a", 1, 10), make_rid("b", 2, 4)
    cut, retry = make_rid("cut", 1, 9), make_rid("r", 3, 5)
    ra, rb, rh, rc, rr = (_request(n, s) for n, s in ((10, 1), (4, 2), (1, 3), (9, 4), (5, 5)))
    out = _forward(proc, [(a, 0, 3, ra), ("HEALTH_CHECK_x", 0, 1, rh), (retry, 0, 2, rr)], pad=3)
    # the original forward still ran: one next-token row per sequence (padding is one too)
    assert out.next_token_logits.shape == (4, V)
    _forward(proc, [("chatcmpl-1", 0, 1, rh), (a, 3, 5, ra), (b, 0, 4, rb),
                    (retry, 0, 5, rr), (cut, 0, 4, rc)], pad=2)
    _forward(proc, [(a, 8, 2, ra), (cut, 6, 3, rc)])  # cut lost rows 4..5: a gap
    _forward(proc, [(a, 0, 1, ra)], mode="DECODE")  # decode passes are never dumped
    hook.writer.flush()
    d = hook.writer.dump_dir
    # Then each whole request equals the same request in one piece, bit for bit in bf16
    for rid, (ids, hid, aux) in ((a, ra), (b, rb), (retry, rr)):
        got = load_file(str(dump_path(d, rid)))
        assert torch.equal(got[T_INPUT_IDS], ids)
        assert torch.equal(got[T_HIDDEN], hid.to(torch.bfloat16))
        assert torch.equal(got[T_AUX], aux.to(torch.bfloat16))
    assert "gap: chunk starts at 6" in err_path(d, cut).read_text()
    ours = sorted(p.name for p in d.iterdir())
    assert ours == sorted([f"{a}.safetensors", f"{b}.safetensors", f"{retry}.safetensors",
                           f"{cut}.err"])


def test_target_verify_and_foreign_batches_cost_nothing(hook: Any) -> None:
    proc = _processor()
    r = _request(4, 6)
    _forward(proc, [(make_rid("tv", 1, 4), 0, 4, r)], mode="TARGET_VERIFY")
    _forward(proc, [("HEALTH_CHECK_1", 0, 4, r)])
    hook.writer.flush()
    assert list(hook.writer.dump_dir.iterdir()) == []
    assert hook.collector is None  # no stager was even built


def _verify(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sglang_patch", "verify", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_verify_passes_on_this_install() -> None:
    ok = _verify()
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("PASS") == 4


def test_verify_fails_when_sglang_does_not_load_the_plugin() -> None:
    # SGLANG_PLUGINS is SGLang's allow-list: without our name there, the loader skips us,
    # exactly as if this project were not installed in the server's interpreter
    res = _verify(env={"SGLANG_PLUGINS": "some_other_plugin"})
    assert res.returncode == 1
    assert "FAIL  plugin loader: SGLang did not apply the hsfarm plugin" in res.stdout
    assert "pip install hsfarm[server]" in res.stdout


def test_verify_fails_on_an_unsupported_sglang_version(tmp_path: Path) -> None:
    # Given an interpreter whose package metadata says sglang 0.4.0 (a dist-info first on the
    # path: what importlib.metadata, and so pip, would report)
    info = tmp_path / "sglang-0.4.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.4.0\n")
    res = _verify(env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    assert res.returncode == 1
    assert ("FAIL  sglang version: SGLang 0.4.0 is not supported (supported: 0.5.23): releases "
            "before 0.5.23 have no --enable-return-aux-hidden-states") in res.stdout


def test_verify_ready_marker_missing_stale_and_fresh(tmp_path: Path) -> None:
    import json
    import time

    missing = _verify("--dump-dir", str(tmp_path))
    assert missing.returncode == 1 and "FAIL  ready marker: none in" in missing.stdout
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    marker = tmp_path / f".ready.{dead.pid}"
    marker.write_text(json.dumps({"pid": dead.pid, "time": time.time() - 7200,
                                  "layers_to_capture": [2, 30, 58]}))
    stale = _verify("--dump-dir", str(tmp_path))
    assert stale.returncode == 1 and "stale, from an earlier server" in stale.stdout
    marker.write_text(json.dumps({"pid": os.getpid(), "time": time.time(),
                                  "layers_to_capture": [2, 30, 58], "server_version": "x"}))
    fresh = _verify("--dump-dir", str(tmp_path))
    assert fresh.returncode == 0, fresh.stdout
    assert "layers [2, 30, 58]" in fresh.stdout


def test_the_hook_refuses_a_dump_dir_another_user_made_before_the_weights_load(
        plugins_loaded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.model_executor.model_runner import ModelRunner

    from engine_dump import dumpdir

    # Given a dump dir another local user (nobody) made first, open to all
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    os.chmod(foreign, 0o777)
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(foreign))
    # When SGLang loads the model through the real, patched ModelRunner.load_model
    runner = SimpleNamespace(server_args=_server_args())
    # Then the server is refused before the original runs (it would need a GPU), with the fix
    with pytest.raises(dumpdir.DumpDirUnsafe, match=f"owned by uid 65534.*rm -rf {foreign}"):
        ModelRunner.load_model(runner)


def test_the_hook_publishes_the_weights_it_loaded(sglang_ctx: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from sglang_patch.tiny_model import ensure_tiny_model

    # Given SGLang serving a local model dir (its --model-path), and a dump dir not made yet
    model_dir = ensure_tiny_model(Path.home() / ".cache" / "hsfarm")
    dumps = tmp_path / "dumps"
    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(dumps))
    monkeypatch.setenv("SGLANG_HS_DUMP_RESERVE_BYTES", "0")
    args = _server_args(tp_size=8)
    args.model_path = str(model_dir)
    inner = torch.nn.Module()
    inner.layers_to_capture = [2, 4, 5]
    runner = SimpleNamespace(server_args=args, model=inner,
                             model_config=SimpleNamespace(hidden_size=H))
    try:
        # When the model loads and the hook comes up, and a request of ours is dumped
        plugin.around_load_model(lambda r: None, runner)
        rid = make_rid("w", 1, 3)
        _forward(_processor(), [(rid, 0, 3, _request(3, 7))])
        plugin._hook.writer.flush()
        # Then the dump dir was made 0700, and the marker (whole) and the dump (its id) carry
        # the weights identity of the files in --model-path: the one the farm computes
        want = weights_identity(model_dir)
        assert (dumps.stat().st_mode & 0o7777) == 0o700
        info = json.loads(next(dumps.glob(".ready.*")).read_text())
        assert info["weights"] == want and len(want["shards"]) == 1
        from safetensors import safe_open

        with safe_open(str(dump_path(dumps, rid)), "pt") as f:
            served = json.loads(f.metadata()[M_WEIGHTS])
        assert served == {"scheme": want["scheme"], "id": want["id"], "shards": 1,
                          "model_path": str(model_dir)}
    finally:
        if plugin._hook is not None:
            plugin._hook.writer.close()
        plugin._hook = plugin._activation = None
