"""NVIDIA Model-Optimizer 0.47.0 reads our export with its own ``OfflineSupervisedDataset`` and
``EagleOfflineDataCollator``, and its HF Trainer path trains its offline EAGLE-3 model two
steps on it (CPU, .venv-modelopt): every row a step consumed is checked against our files.
Nothing of it is patched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.trainers.conftest import assert_in_place_equals_export, assert_training_extra_keeps, ours

TRAIN_LEN = 48  # below the longest sample: its truncation is exercised
STEP_LEN = 256  # the training steps: every sample holds answer tokens within it


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


def test_its_hf_trainer_trains_two_steps_and_each_row_it_trained_on_is_ours(
        data: Path, tmp_path: Path) -> None:
    # Given the tiny target (in bf16, as its offline recipe loads it) converted by modelopt
    # into an offline EAGLE-3 model, trained as its example's main.py does: a transformers
    # Trainer over its OfflineSupervisedDataset and EagleOfflineDataCollator (its example's
    # Trainer subclass only adds accuracy logging), on CPU; a forward pre-hook records every
    # batch a step consumes
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from modelopt.torch.speculative.eagle.utils import (
        EagleOfflineDataCollator,
        OfflineSupervisedDataset,
    )
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(data / "model", dtype=torch.bfloat16)
    arch = {**EAGLE3_DEFAULT_CFG["config"]["eagle_architecture_config"],
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16,  # sized for the tiny target (its default is Llama-8B's)
            "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # ours [2, 4, 5] minus one
    cfg = {**EAGLE3_DEFAULT_CFG["config"], "eagle_offline": True,
           "eagle_use_torch_compile": False,  # its own option: Inductor would compile for minutes
           "eagle_architecture_config": arch}
    mtsp.convert(model, [("eagle", cfg)])
    files = sorted((data / "modelopt").rglob("*.pt"))
    seen: list[dict[str, Any]] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append({**kwargs, "train": module.training}),
        with_kwargs=True)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-3, use_cpu=True,
                             report_to="none", logging_steps=1, save_strategy="no",
                             remove_unused_columns=False, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, data_collator=EagleOfflineDataCollator(STEP_LEN),
                      train_dataset=OfflineSupervisedDataset([str(f) for f in files],
                                                             answer_only_loss=True))
    trainer.can_return_loss = True
    # When it trains
    result = trainer.train()
    # Then it took two steps with finite losses
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert result.global_step == 2 and len(losses) == 2
    assert all(np.isfinite(x) and x > 0 for x in losses)
    print(f"modelopt step losses {losses}")
    # And each row it trained on is ours, zero-padded to train_len, its labels our ids
    # shifted left by one
    farm = ours(data)
    rows = 0
    for b in seen:
        for row in range(b["input_ids"].shape[0]):
            n = int(b["attention_mask"][row].sum())
            assert any(_is_row(b, row, n, want) for want in farm.values()), row
            rows += 1
    assert rows == 4


def _is_row(b: dict[str, Any], row: int, n: int, want: dict[str, Any]) -> bool:
    """Row ``row`` (``n`` tokens before padding) of a batch is ``want`` after its collator."""
    base = b["base_model_outputs"]
    return (n == min(STEP_LEN, len(want["input_ids"]))
            and torch.equal(b["input_ids"][row, :n], want["input_ids"][:n])
            and torch.equal(b["loss_mask"][row, :n], want["loss_mask"][:n])
            and torch.equal(base["base_model_hidden_states"][row, :n], want["hidden_state"][:n])
            and torch.equal(base["aux_hidden_states"][row, :n], want["aux_hidden_state"][:n])
            and torch.equal(b["labels"][row, : n - 1], want["input_ids"][1:n]))


def test_the_training_extra_installs_beside_it_without_changing_its_transformers() -> None:
    # Given this trainer's venv, its transformers (and torch) as the trainer pins them
    # When pip resolves `pip install hsfarm[training]` into it, Then neither would change
    assert_training_extra_keeps({"transformers": "<5.15", "torch": "==2.13.0"})


def test_our_loader_beside_it_reads_in_place_what_its_export_holds(data: Path) -> None:
    # Given hsfarm[training] installed in this venv, When our loader reads the output dir in
    # place in Model-Optimizer's view, Then each sample is its .pt as its dataset loads it
    exported = {p.name[: -len(".pt")]: torch.load(p, weights_only=True)
                for p in (data / "modelopt").rglob("*.pt")}
    assert_in_place_equals_export(data, "modelopt", exported)


def test_an_fp8_runs_export_gives_its_dequantized_bf16_tensors(data: Path) -> None:
    # Given an fp8 run (e4m3 and scales on disk) exported for Model-Optimizer (bf16 .pt),
    # Then its dataset gives our stored values times their scales, and so does ours in place
    test_its_dataset_and_collator_give_our_tensors_after_its_transforms(data / "fp8")
    test_our_loader_beside_it_reads_in_place_what_its_export_holds(data / "fp8")
