"""SpecForge 0.2.0 reads our export with its own reader, store, normalizer and collator, and
trains its EAGLE-3 draft model one step on it (CPU, .venv-specforge).

Patched, test harness only: SpecForge's loss is a Triton kernel (``LogSoftmaxLoss``, GPU
only), and ``specforge.core.loss`` imports ``triton`` at module level. A stand-in ``triton``
module lets it import; ``LogSoftmaxLoss.apply`` is replaced by the same math in torch (its own
reference formula, ``_compute_loss``, without ``torch.compile``). Nothing else is touched.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainers.conftest import ours

MAX_LEN = 40  # below the longest sample: SpecForge's truncation is exercised


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


def test_one_training_step_of_its_eagle3_draft_model(data: Path) -> None:
    # Given SpecForge's EAGLE-3 draft model (Llama, 1 layer) sized for the tiny target, over
    # the full vocabulary (the random target's argmax tokens are rarely among the 64 most
    # frequent answer tokens, which would mask every position), the target's LM head as the
    # teacher head
    from safetensors.torch import load_file
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                         vocab_size=642, draft_vocab_size=642, target_hidden_size=64,
                         rms_norm_eps=1e-6, max_position_embeddings=4096, pad_token_id=5)
    draft = LlamaForCausalLMEagle3(config, attention_backend="sdpa")
    head = load_file(str(data / "model" / "model.safetensors"))["lm_head.weight"]
    model = OnlineEagle3Model(draft, length=3, attention_backend="sdpa")
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    before = {n: p.detach().clone() for n, p in draft.named_parameters() if p.requires_grad}
    # When one step runs on a batch from SpecForge's own loader and collator
    t = _batches(data, batch_size=2, max_len=2048)[0].tensors  # whole samples
    assert t["loss_mask"].sum() > 0
    plosses, *_ = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                        target=None, loss_mask=t["loss_mask"][..., None],  # as its strategy does
                        hidden_states=t["hidden_state"].float(),
                        target_hidden_for_compact=t["target"].float(),
                        target_head_weight=head.float())
    loss = sum(plosses) / len(plosses)
    loss.backward()
    optimizer.step()
    # Then the loss is finite and the weights changed
    assert torch.isfinite(loss) and loss.item() > 0
    changed = [n for n, p in draft.named_parameters() if p.requires_grad
               and not torch.equal(p.detach(), before[n])]
    assert "fc.weight" in changed and len(changed) >= len(before) // 2, changed
