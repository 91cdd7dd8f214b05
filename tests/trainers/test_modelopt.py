"""NVIDIA Model-Optimizer 0.47.0 reads our export with its own ``OfflineSupervisedDataset`` and
``EagleOfflineDataCollator`` (CPU, .venv-modelopt). Nothing of it is patched.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.trainers.conftest import ours

TRAIN_LEN = 48  # below the longest sample: its truncation is exercised


def test_its_dataset_and_collator_give_our_tensors_after_its_transforms(data: Path) -> None:
    # Given our files and their Model-Optimizer export, found as its example finds them
    from modelopt.torch.speculative.eagle.utils import (
        EagleOfflineDataCollator,
        OfflineSupervisedDataset,
    )

    farm = ours(data)
    files = sorted((data / "modelopt").rglob("*.pt"))
    assert len(files) == len(farm) and max(len(t["input_ids"]) for t in farm.values()) > TRAIN_LEN
    # When its dataset (answer_only_loss=True, else it ignores our mask) and collator load them
    ds = OfflineSupervisedDataset([str(f) for f in files], answer_only_loss=True)
    batch = EagleOfflineDataCollator(TRAIN_LEN)([ds[i] for i in range(len(ds))])
    # Then each row is ours, truncated or zero-padded to train_len, labels shifted by one
    base = batch["base_model_outputs"]
    assert base["base_hidden_prenorm"] is False
    for row, f in enumerate(files):
        want = farm[f.name[: -len(".pt")]]
        n = min(TRAIN_LEN, len(want["input_ids"]))
        assert torch.equal(batch["input_ids"][row, :n], want["input_ids"][:n])
        assert torch.equal(batch["loss_mask"][row, :n], want["loss_mask"][:n])
        assert torch.equal(base["base_model_hidden_states"][row, :n], want["hidden_state"][:n])
        assert torch.equal(base["aux_hidden_states"][row, :n], want["aux_hidden_state"][:n])
        assert torch.equal(batch["labels"][row, : n - 1], want["input_ids"][1:n])
        assert not batch["loss_mask"][row, n:].any()
    # And without answer_only_loss it silently trains on every token (the README's warning)
    default = OfflineSupervisedDataset([str(files[0])])[0]
    assert bool(default["loss_mask"].all()) and not bool(farm[files[0].stem]["loss_mask"].all())


def test_one_training_step_of_its_eagle3_draft_model(data: Path) -> None:
    # Given the tiny target (in bf16, as its offline recipe loads it) converted by modelopt
    # into an offline EAGLE-3 model, and a batch from its own dataset and collator
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from modelopt.torch.speculative.eagle.utils import (
        EagleOfflineDataCollator,
        OfflineSupervisedDataset,
    )
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(data / "model", dtype=torch.bfloat16)
    arch = {**EAGLE3_DEFAULT_CFG["config"]["eagle_architecture_config"],
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16,  # sized for the tiny target (its default is Llama-8B's)
            "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # ours [2, 4, 5] minus one
    cfg = {**EAGLE3_DEFAULT_CFG["config"], "eagle_offline": True,
           "eagle_architecture_config": arch}
    mtsp.convert(model, [("eagle", cfg)])
    files = sorted((data / "modelopt").rglob("*.pt"))[:2]
    ds = OfflineSupervisedDataset([str(f) for f in files], answer_only_loss=True)
    batch = EagleOfflineDataCollator(256)([ds[0], ds[1]])
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    # When one step runs
    model.train()
    out = model(**batch)
    out.loss.backward()
    optimizer.step()
    # Then the loss is finite and the draft's weights changed
    assert torch.isfinite(out.loss) and out.loss.item() > 0
    changed = sum(not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))
    assert changed >= len(params) // 2, (changed, len(params))
