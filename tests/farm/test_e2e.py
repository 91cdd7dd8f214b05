"""End to end: private Redis, reference server, two real Celery workers, real files."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine_dump.dumpfile import T_AUX, T_HIDDEN, T_INPUT_IDS, T_LOSS_MASK
from producer.localfarm.farm import LocalFarm
from tests.conftest import assert_farm_invariants, wait_finished, write_samples
from worker.core import outdir


@functools.cache
def _model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def direct_forward(model_dir: Path, ids: list[int],
                   layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ids through transformers directly: (final post-norm [T,H], aux [T,3H])."""
    out = _model(model_dir).model(torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
    return out.last_hidden_state[0], aux


def _assistant_text(sample: dict[str, Any]) -> str:
    msgs = sample.get("messages") or [
        {"role": "assistant" if m["from"] == "gpt" else m["from"], "content": m["value"]}
        for m in sample["conversations"]]
    return "".join(m["content"].strip() + "<|eot_id|>" for m in msgs
                   if m["role"] == "assistant")


def test_end_to_end_two_workers(farm: LocalFarm, tmp_path: Path, tiny_model: Path,
                                tokenizer: Any) -> None:
    # Given 60 varied samples and two workers of two processes each
    data = tmp_path / "data.json"
    samples = write_samples(data, 60)
    farm.start_worker("w1", concurrency=2)
    farm.start_worker("w2", concurrency=2)
    # When they are enqueued and the farm runs to the end
    res = farm.cli("enqueue", str(data), "--no-progress")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "published: 60" in res.stdout
    wait_finished(farm, 60)
    # Then there is exactly one verified file per sample and nothing left over
    keys = [str(s["id"]) for s in samples]
    assert_farm_invariants(farm, keys)
    assert farm.cli("status", "--check").returncode == 0
    status = json.loads(farm.cli("status", "--json").stdout)
    assert (status["total"], status["done"], status["queued"], status["failed"]) == (60, 60, 0, 0)
    assert status["bytes"] > 0 and status["tokens"] > 0 and status["finished"]
    # And every file holds the model's real hidden states and the assistant-only loss mask
    for sample, key in zip(samples, keys, strict=True):
        t = load_file(str(outdir.final_path(farm.output_dir, key)))
        ids = t[T_INPUT_IDS].tolist()
        hid, aux = direct_forward(tiny_model, ids, (2, 4, 5))
        assert t[T_HIDDEN].dtype == torch.bfloat16 and t[T_HIDDEN].shape == (len(ids), 64)
        assert t[T_AUX].shape == (len(ids), 3 * 64)
        torch.testing.assert_close(t[T_HIDDEN].float(), hid, atol=0.02, rtol=0.02)
        torch.testing.assert_close(t[T_AUX].float(), aux, atol=0.02, rtol=0.02)
        masked = [i for i, m in zip(ids, t[T_LOSS_MASK].tolist(), strict=True) if m]
        assert tokenizer.decode(masked) == _assistant_text(sample)
    # Both workers took part
    logs = [farm.procs[w].log.read_text() for w in ("w1", "w2")]
    assert all(" done n=" in log for log in logs)
