"""vLLM speculators 0.9.0 reads our export with its own ``ArrowDataset`` and ``CollateFn``; its
``verifier_norm`` (the target's final-norm weight, which it loads itself) maps our derived
pre-norm slot back to our post-norm ``hidden_state``; and its training CLI
(``python -m speculators.train``) trains its EAGLE-3 draft two steps on it (CPU,
.venv-speculators): every packed row a step consumed is checked against our files after its
``shift_batch``.

Chosen, not patched: the draft's attention is ``sdpa`` (its default flex attention compiles
kernels) and the loss implementation ``eager`` (the default ``fused`` one is a compiled kernel),
both of its own options (``--draft-attn-impl sdpa --loss-implementation eager``). Replaced in
the CLI test only, because there is no accelerator: its Trainer's device and
``torch.accelerator.synchronize`` (see the test).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainers.conftest import (
    assert_in_place_equals_export,
    assert_training_extra_keeps,
    manifest,
    ours,
)

MAX_LEN = 4096  # a packed batch of 4 samples holds them whole


def _dataset(data: Path) -> Any:
    from speculators.train.data import ArrowDataset

    return ArrowDataset(max_len=MAX_LEN, datapath=str(data / "speculators"), on_missing="raise")


def _keys_by_row(data: Path) -> list[str]:
    from safetensors import safe_open

    rows = []
    for i in range(len(list((data / "speculators" / "hidden_states").glob("hs_*.safetensors")))):
        with safe_open(str(data / "speculators" / "hidden_states" / f"hs_{i}.safetensors"),
                       framework="pt") as f:
            rows.append(f.metadata()["sample_key"])
    return rows


@pytest.fixture(scope="module")
def draft(data: Path) -> Any:
    """Its EAGLE-3 draft model for the tiny verifier, built as its trainer builds it."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(data / "model")
    freq = torch.load(data / "speculators" / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, config.vocab_size,
                                                      config.vocab_size)
    return Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=d2t, verifier_name_or_path=str(data / "model"),
        draft_vocab_size=config.vocab_size, norm_before_residual=False, ttt_steps=3,
        draft_attn_impl="sdpa",
        target_layer_ids=manifest(data)["fingerprint"]["layers_to_capture"])


def _rows_are_ours(data: Path) -> tuple[Any, dict[str, dict[str, Any]], list[str]]:
    """Its ArrowDataset over the export; every row checked against our file (its dataset,
    our files by key, the keys by row)."""
    farm = ours(data)
    keys = _keys_by_row(data)
    assert sorted(keys) == sorted(farm)
    # When its ArrowDataset reads each row (it checks token_ids against the Arrow input_ids)
    ds = _dataset(data)
    assert len(ds) == len(farm) and ds.approx_lengths == [len(farm[k]["input_ids"]) for k in keys]
    for i, key in enumerate(keys):
        item = ds[i]
        want = farm[key]
        # Then ids, mask and the three aux states are ours, unchanged
        assert torch.equal(item["input_ids"], want["input_ids"])
        assert torch.equal(item["loss_mask"], want["loss_mask"])
        assert torch.equal(item["hidden_states"], want["aux_hidden_state"])
        assert torch.equal(item["position_ids"], torch.arange(len(want["input_ids"])))
    return ds, farm, keys


def test_its_dataset_and_collator_give_our_tensors(data: Path) -> None:
    # Given our files and their speculators export (Arrow rows + hs_{i}.safetensors)
    ds, farm, keys = _rows_are_ours(data)
    # And its collator packs them in order, padding the rest
    from speculators.train.data import CollateFn

    batch = CollateFn(MAX_LEN, hidden_size=64)([ds[i] for i in range(4)])
    n = sum(len(farm[k]["input_ids"]) for k in keys[:4])
    assert n < MAX_LEN
    assert torch.equal(batch["input_ids"][0, :n],
                       torch.cat([farm[k]["input_ids"] for k in keys[:4]]))
    assert torch.equal(batch["hidden_states"][0, :n],
                       torch.cat([farm[k]["aux_hidden_state"] for k in keys[:4]]))
    assert not batch["loss_mask"][0, n:].any() and (batch["document_ids"][0, n:] == -1).all()


def test_its_verifier_norm_on_slot_4_gives_our_post_norm_state(data: Path, draft: Any) -> None:
    # Given its draft model, whose verifier_norm it loaded from the target model itself
    from safetensors.torch import load_file

    model_norm = load_file(str(data / "model" / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(draft.verifier_norm.weight.float(), model_norm.float())
    assert not torch.allclose(model_norm, torch.ones_like(model_norm))  # not a blind check
    farm, ds, keys = ours(data), _dataset(data), _keys_by_row(data)
    for i, key in enumerate(keys):
        # When its verifier_norm is applied to slot 4 (its verifier_last_hidden_states)
        slot4 = ds[i]["verifier_last_hidden_states"]
        with torch.no_grad():
            normed = draft.verifier_norm(slot4.float())
        # Then it equals our post-norm hidden_state within bf16 rounding (and normalising our
        # post-norm state a second time, the bug this guards against, does not)
        want = farm[key]["hidden_state"].float()
        torch.testing.assert_close(normed, want, rtol=2 ** -7, atol=1e-2)
        with torch.no_grad():
            twice = draft.verifier_norm(want)
        assert not torch.allclose(twice, want, rtol=2 ** -7, atol=1e-2)


def _cli_args(data: Path, save: Path) -> list[str]:
    """`python -m speculators.train` on the export, with its sdpa attention and eager loss."""
    return ["--verifier-name-or-path", str(data / "model"),
            "--data-path", str(data / "speculators"), "--save-path", str(save),
            "--target-layer-ids", *map(str, manifest(data)["fingerprint"]["layers_to_capture"]),
            "--token-freq-path", str(data / "speculators" / "token_freq.pt"),
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--ttt-steps", "3",
            "--total-seq-len", "512", "--max-steps", "2", "--epochs", "1", "--num-workers", "0",
            "--on-missing", "raise", "--log-freq", "1", "--no-resume-from-checkpoint"]


def test_its_cli_trains_two_steps_and_each_row_it_trained_on_is_ours_after_shift_batch(
        data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given its training CLI's main on the export, in this process (hooks on its draft model
    # record every batch a step consumes, after its collator and shift_batch). CPU only, the
    # harness replaces two accelerator calls: its Trainer's device (the local rank, an
    # accelerator index) becomes "cpu", and torch.accelerator.synchronize (its step timer)
    # does nothing
    import speculators.train.trainer as trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    monkeypatch.setattr(trainer, "get_local_rank", lambda: "cpu")
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    seen: list[dict[str, Any]] = []
    setup_model = trainer.Trainer.setup_model

    def recorded_setup(self: Any) -> None:
        setup_model(self)

        def before(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            seen.append({"train": module.training, **{k: v.detach().clone()
                                                      for k, v in kwargs.items()
                                                      if isinstance(v, torch.Tensor)}})

        def after(module: Any, args: Any, kwargs: Any, out: Any) -> None:
            seen[-1]["loss"] = out[1].detach()

        self.model.register_forward_pre_hook(before, with_kwargs=True)
        self.model.register_forward_hook(after, with_kwargs=True)

    monkeypatch.setattr(trainer.Trainer, "setup_model", recorded_setup)
    # When it trains
    main(TrainConfig.resolve(_cli_args(data, tmp_path / "ckpt")))
    # Then it took two training steps, each loss finite
    steps = [b for b in seen if b["train"]]
    assert len(steps) == 2 and all(torch.isfinite(b["loss"]) for b in steps)
    print(f"speculators step losses {[round(b['loss'].item(), 4) for b in steps]}")
    # And every packed document it trained (and validated) on is one of our samples after
    # shift_batch: ids, loss mask, positions and its slot-4 state from token 1 on, our aux
    # states up to the last token
    farm, keys = ours(data), _keys_by_row(data)
    docs = 0
    for b in seen:
        for d in b["document_ids"][0].unique().tolist():
            if d < 0:
                continue
            at = b["document_ids"][0] == d
            assert any(_is_document(b, at, data, keys.index(k), t)
                       for k, t in farm.items()), d
            docs += 1
    assert docs >= len(steps)


def _is_document(b: dict[str, Any], at: torch.Tensor, data: Path, row: int,
                 want: dict[str, Any]) -> bool:
    """The positions ``at`` of a packed batch are sample ``want`` (export row ``row``) after
    its ``shift_batch``."""
    from safetensors.torch import load_file

    n = int(at.sum())
    if not torch.equal(b["input_ids"][0, at], want["input_ids"][1:n + 1]):
        return False
    slot4 = load_file(str(data / "speculators" / "hidden_states" /
                          f"hs_{row}.safetensors"))["hidden_states"][:, -1]
    return (torch.equal(b["hidden_states"][0, at], want["aux_hidden_state"][:n])
            and torch.equal(b["verifier_last_hidden_states"][0, at], slot4[1:n + 1])
            and torch.equal(b["loss_mask"][0, at], want["loss_mask"][1:n + 1])
            and torch.equal(b["position_ids"][0, at], torch.arange(1, n + 1)))


def test_the_training_extra_installs_beside_it_without_changing_its_transformers() -> None:
    # Given this trainer's venv, its transformers (and torch) as the trainer pins them
    # When pip resolves `pip install hsfarm[training]` into it, Then neither would change
    assert_training_extra_keeps({"transformers": "<=5.19.0", "torch": "==2.13.0"})


def test_our_loader_beside_it_reads_in_place_what_its_export_holds(data: Path) -> None:
    # Given hsfarm[training] installed in this venv, When our loader reads the output dir in
    # place in speculators' view, Then each sample is its hs_{i}.safetensors
    from safetensors.torch import load_file

    exported = {key: load_file(str(data / "speculators" / "hidden_states" / f"hs_{i}.safetensors"))
                for i, key in enumerate(_keys_by_row(data))}
    assert_in_place_equals_export(data, "speculators", exported)


def test_an_fp8_runs_export_gives_its_dequantized_bf16_tensors(data: Path) -> None:
    # Given an fp8 run exported for speculators 0.9.0 (bf16: its reader has no fp8 layout),
    # Then its dataset gives our stored values times their scales, and so does ours in place
    _rows_are_ours(data / "fp8")
    test_our_loader_beside_it_reads_in_place_what_its_export_holds(data / "fp8")
