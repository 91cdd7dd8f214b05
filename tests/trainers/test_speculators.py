"""vLLM speculators 0.9.0 reads our export with its own ``ArrowDataset`` and ``CollateFn``; its
``verifier_norm`` (the target's final-norm weight, which it loads itself) maps our derived
pre-norm slot back to our post-norm ``hidden_state``; and its EAGLE-3 draft model trains one
step on it (CPU, .venv-speculators).

Chosen, not patched: the draft's attention is ``sdpa`` (its default flex attention compiles
kernels) and the loss implementation ``eager`` (the default ``fused`` one is a compiled kernel),
both of its own options (``--draft-attn-impl sdpa --loss-implementation eager``). Nothing of
speculators is patched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainers.conftest import manifest, ours

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


def test_its_dataset_and_collator_give_our_tensors(data: Path) -> None:
    # Given our files and their speculators export (Arrow rows + hs_{i}.safetensors)
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


def test_one_training_step_of_its_eagle3_draft_model(data: Path, draft: Any) -> None:
    # Given a packed batch from its own dataset and collator (hidden states in float32, the
    # draft's dtype on CPU, through the collator's own dtype option), and its eager loss
    from speculators.train.data import CollateFn

    ds = _dataset(data)
    items = [ds[0], ds[1]]
    packed_len = sum(len(it["input_ids"]) for it in items)  # no padding: a short CPU step
    batch = CollateFn(packed_len, hidden_size=64, dtype=torch.float32)(items)
    train_kwargs, _ = draft.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                               ttt_steps=3, ttt_step_loss_decay=1.0)
    params = [p for p in draft.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    # When one step runs
    draft.train()
    _, loss, _ = draft(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)},
                       **train_kwargs)
    loss.backward()
    optimizer.step()
    # Then the loss is finite and the weights changed
    assert torch.isfinite(loss) and loss.item() > 0
    changed = sum(not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    assert changed >= len(params) // 2, (changed, len(params))
