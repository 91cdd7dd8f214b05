"""SpecForge 0.2.0 reads our export with its own reader, store, normalizer and collator, and
its `specforge train` CLI trains its EAGLE-3 draft two steps on it (CPU, .venv-specforge):
every row a step consumed is checked against our files after its shift.

Patched, test harness only: SpecForge's loss is a Triton kernel (``LogSoftmaxLoss``, GPU
only), and ``specforge.core.loss`` imports ``triton`` at module level. A stand-in ``triton``
module lets it import; ``LogSoftmaxLoss.apply`` is replaced by the same math in torch (its own
reference formula, ``_compute_loss``, without ``torch.compile``). Nothing else is replaced;
the CLI test wraps (and runs unchanged) its strategy's ``forward_loss`` to see each batch.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainers.conftest import assert_in_place_equals_export, assert_training_extra_keeps, ours

MAX_LEN = 40  # below the longest sample: SpecForge's truncation is exercised
CLI_MAX_LEN = 64  # likewise, for the CLI's run (CPU steps of a few seconds)


class _Anything(types.ModuleType):
    """A module whose every attribute is a no-op decorator/value (import-time only)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # not a package, no spec: torch's probes see no Triton
            raise AttributeError(name)
        return lambda *a, **k: (a[0] if len(a) == 1 and callable(a[0]) else None)


def _torch_log_softmax_loss(logits: torch.Tensor, target_p: torch.Tensor,
                            position_mask: torch.Tensor) -> torch.Tensor:
    """What SpecForge's Triton kernel computes (its reference ``_compute_loss``)."""
    logp = torch.log_softmax(logits.float(), dim=2)
    return -torch.sum(position_mask * target_p * logp, 2).mean()


@pytest.fixture(scope="module", autouse=True)
def cpu_loss() -> Any:
    torch.compile(lambda x: x)  # torch's own Triton probes run now, before the stand-in

    triton = sys.modules["triton"] = _Anything("triton")
    triton.language = sys.modules["triton.language"] = _Anything("triton.language")  # type: ignore[attr-defined]
    try:
        from specforge.core import loss
    finally:  # the stand-in only lets that module import; nothing else sees it
        del sys.modules["triton"], sys.modules["triton.language"]

    original = loss.LogSoftmaxLoss.apply
    loss.LogSoftmaxLoss.apply = staticmethod(_torch_log_softmax_loss)
    yield
    loss.LogSoftmaxLoss.apply = original


def _batches(data: Path, batch_size: int, max_len: int = MAX_LEN) -> list[Any]:
    from specforge.algorithms.eagle3.data import build_offline_collator, build_offline_normalizer
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    refs = OfflineManifestReader(str(data / "specforge"), max_len=max_len).read()
    loader = FeatureDataLoader(LocalFeatureStore(), refs=refs, batch_size=batch_size,
                               collate_fn=build_offline_collator(),
                               per_sample_transform=build_offline_normalizer(max_len),
                               ack=False, drop_last=False)
    return list(loader)


def test_its_loader_and_collator_give_our_tensors_after_its_transforms(data: Path) -> None:
    # Given our files and their SpecForge export, listed as SpecForge lists them
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    farm = ours(data)
    files = list_feature_files(str(data / "specforge"))
    assert len(files) == len(farm) and max(len(t["input_ids"]) for t in farm.values()) > MAX_LEN
    # When SpecForge's reader, store, eagle3 normalizer and padding collator load them
    batches = _batches(data, batch_size=2)
    # Then every sample equals ours after its documented transforms: truncation to max_len,
    # the last kept token's loss mask set to 0, aux as its input and our final state as target
    seen = 0
    for batch in batches:
        t = batch.tensors
        for row, sample_id in enumerate(batch.sample_ids):
            key = Path(files[int(sample_id.split(":")[1])]).name[: -len(".ckpt")]
            want = farm[key]
            n = min(MAX_LEN, len(want["input_ids"]))
            mask = want["loss_mask"][:n].clone()
            mask[-1] = 0
            assert torch.equal(t["input_ids"][row, :n], want["input_ids"][:n])
            assert torch.equal(t["loss_mask"][row, :n], mask)
            assert torch.equal(t["hidden_state"][row, :n], want["aux_hidden_state"][:n])
            assert torch.equal(t["target"][row, :n], want["hidden_state"][:n])
            assert not t["loss_mask"][row, n:].any() and not t["target"][row, n:].any()
            seen += 1
    assert seen == len(farm)


def test_its_token_counts_equal_ours_and_it_loads_our_vocab_mapping(data: Path) -> None:
    # Given SpecForge's own count over the export (no truncation) and its own mapping
    from safetensors.torch import load_file
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    theirs = count_effective_feature_tokens(str(data / "specforge"), max_length=10**6)
    counts = load_file(str(data / "out" / "token_counts.safetensors"))["counts"]
    # Then our index counted the same loss-masked tokens
    assert {t: int(n) for t, n in enumerate(counts.tolist()) if n} == dict(theirs)
    # And our d2t/t2d pick a top-64 set as SpecForge's does (ties at the cut may differ)
    mapping = torch.load(data / "out" / "vocab_mapping-64.pt")
    d2t, t2d = process_token_dict_to_mappings(theirs.copy(), 64, len(t2d_ := mapping["t2d"]))
    ours_used = torch.nonzero(t2d_).flatten()
    theirs_used = torch.nonzero(t2d).flatten()
    assert sorted(counts[ours_used].tolist()) == sorted(counts[theirs_used].tolist())
    assert torch.equal(mapping["d2t"], ours_used - torch.arange(64))
    cut = sorted(counts.tolist(), reverse=True)[63]
    if sorted(counts.tolist(), reverse=True)[64] != cut:  # no tie at the cut: same set
        assert torch.equal(mapping["d2t"], d2t) and torch.equal(mapping["t2d"], t2d)


def _run_config(data: Path, tmp: Path) -> Path:
    """A `specforge train` config for the export: its EAGLE-3 draft (Llama, 1 layer) sized
    for the tiny target, over the full vocabulary (the random target's argmax tokens are
    rarely among the most frequent answer tokens, which would mask every position).

    Its ``TargetHead`` finds the LM head only through a ``*.safetensors.index.json``: the
    target dir here links the tiny model's files and adds that index. DDP
    (``fsdp_sharding: NO_SHARD``, its own choice for a replicated draft): its FSDP needs an
    accelerator.
    """
    import json

    from safetensors import safe_open

    model = tmp / "model"
    model.mkdir()
    for f in (data / "model").iterdir():
        (model / f.name).symlink_to(f)
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    draft = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
             "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
             "vocab_size": 642, "draft_vocab_size": 642, "target_hidden_size": 64,
             "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "pad_token_id": 5,
             "hidden_act": "silu", "rope_theta": 10000.0, "torch_dtype": "bfloat16",
             "tie_word_embeddings": False}
    (tmp / "draft.json").write_text(json.dumps(draft))
    run = {"model": {"target_model_path": str(model),
                     "draft_model_config": str(tmp / "draft.json")},
           "data": {"hidden_states_path": str(data / "specforge"), "max_length": CLI_MAX_LEN},
           "training": {"fsdp_sharding": "NO_SHARD", "max_steps": 2, "batch_size": 2,
                        "ttt_length": 3, "attention_backend": "sdpa", "log_interval": 1,
                        "learning_rate": 1e-3},
           "output_dir": str(tmp / "out")}
    (tmp / "run.json").write_text(json.dumps(run))
    return tmp / "run.json"


def test_its_cli_trains_two_steps_and_each_row_it_trained_on_is_ours_after_its_shift(
        data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given `specforge train -c run.json` on the export (its CLI's main, in this process, so
    # the batches its strategy consumes are seen: Eagle3TrainStrategy.forward_loss is wrapped
    # to record its batch, TargetHead.preprocess's output and the loss, and runs unchanged)
    import socket

    from specforge import cli
    from specforge.runtime.data_plane.offline_reader import list_feature_files
    from specforge.training.strategies.base import Eagle3TrainStrategy

    config = _run_config(data, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "FSDP_SHARDING": "NO_SHARD"}.items():
        monkeypatch.setenv(k, v)  # what its single-process launch sets, undone after
    seen: list[dict[str, Any]] = []
    forward_loss = Eagle3TrainStrategy.forward_loss

    def recorded(self: Any, batch: Any, ctx: Any = None) -> Any:
        rec: dict[str, Any] = {"ids": list(batch.sample_ids),
                               "batch": {k: v.detach().clone() for k, v in batch.tensors.items()}}
        preprocess = self.target_head.preprocess

        def shifted(*args: Any) -> Any:
            out = preprocess(*args)
            rec["shifted"] = [x.detach().clone() for x in out]
            return out

        self.target_head.preprocess = shifted
        try:
            out = forward_loss(self, batch, ctx)
        finally:
            del self.target_head.preprocess
        rec["loss"], rec["plosses"] = out.loss.detach(), list(out.metrics["plosses"])
        seen.append(rec)
        return out

    monkeypatch.setattr(Eagle3TrainStrategy, "forward_loss", recorded)
    # When it trains
    assert cli.main(["train", "-c", str(config)]) == 0
    # Then it took two steps, each loss finite and its plosses weighted 0.8^i
    assert len(seen) == 2
    for rec in seen:
        p = rec["plosses"]
        assert len(p) == 3 and all(torch.isfinite(x) for x in p)
        torch.testing.assert_close(rec["loss"], sum(0.8**i * x for i, x in enumerate(p)))
        print(f"specforge step loss {rec['loss'].item():.4f} plosses "
              f"{[round(x.item(), 4) for x in p]}")
    # And every row it trained on is ours after its documented transforms: truncated to
    # max_length, the last kept position's loss mask 0; the draft's input our aux states;
    # ids and target hidden state shifted left by one (TargetHead.preprocess), zero-padded
    farm, files = ours(data), list_feature_files(str(data / "specforge"))
    rows = 0
    for rec in seen:
        ids, target, mask = rec["shifted"]
        for row, sample_id in enumerate(rec["ids"]):
            want = farm[Path(files[int(sample_id.split(":")[1])]).name[: -len(".ckpt")]]
            n = min(CLI_MAX_LEN, len(want["input_ids"]))
            assert torch.equal(rec["batch"]["hidden_state"][row, :n], want["aux_hidden_state"][:n])
            assert torch.equal(ids[row, : n - 1], want["input_ids"][1:n])
            assert torch.equal(target[row, : n - 1], want["hidden_state"][1:n])
            assert not ids[row, n - 1:].any() and not target[row, n - 1:].any()
            m = want["loss_mask"][:n].clone()
            m[-1] = 0
            assert torch.equal(mask[row, :n, 0], m) and not mask[row, n:].any()
            rows += 1
    assert rows == 4


def test_the_training_extra_installs_beside_it_without_changing_its_transformers() -> None:
    # Given this trainer's venv, its transformers (and torch) as the trainer pins them
    # When pip resolves `pip install hsfarm[training]` into it, Then neither would change
    assert_training_extra_keeps({"transformers": "==5.8.1", "torch": "==2.13.0"})


def test_our_loader_beside_it_reads_in_place_what_its_export_holds(data: Path) -> None:
    # Given hsfarm[training] installed in this venv, When our loader reads the output dir in
    # place in SpecForge's view, Then each sample is its .ckpt as SpecForge loads it
    exported = {p.name[: -len(".ckpt")]: torch.load(p, weights_only=False, mmap=True)
                for p in (data / "specforge").rglob("*.ckpt")}
    assert_in_place_equals_export(data, "specforge", exported)


def test_an_fp8_runs_export_gives_its_dequantized_bf16_tensors(data: Path) -> None:
    # Given an fp8 run (e4m3 and scales on disk) exported for SpecForge (bf16, its format),
    # Then its loader gives our stored values times their scales, and so does ours in place
    test_its_loader_and_collator_give_our_tensors_after_its_transforms(data / "fp8")
    test_our_loader_beside_it_reads_in_place_what_its_export_holds(data / "fp8")
