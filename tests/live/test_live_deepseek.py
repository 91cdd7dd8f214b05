"""Kimi-K2.5's code path (``DeepseekV3ForCausalLM``: MLA attention, MoE) in a live server.

What runs on this CPU: the launch, with SGLang's own DeepSeek model classes built and loaded,
and the hook coming up with the capture ids (``DeepseekV2Model``, which Kimi-K2.5 wraps, starts
with none: the start-up failure of issue 7). What cannot: a forward pass. On a CPU without
AMX SGLang 0.5.23 falls back to the ``torch_native`` attention backend, which has no MLA
support (docs/sglang-live.md has the error); so no request is sent and no dump is compared
here, and the transformers comparison of the capture runs with the Llama model instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import CACHE
from tests.live.conftest import running
from tests.live.sglang_server import LiveServer, get_json
from tests.live.tiny_deepseek import ensure_tiny_deepseek


def test_deepseek_v3_the_hook_comes_up_once_sglang_sets_the_ids(tmp_path: Path,
                                                               tiny_model: Path) -> None:
    # Given a tiny DeepSeek-V3 (MLA, 4 routed experts + 1 shared, 8 layers)
    model = ensure_tiny_deepseek(CACHE, tiny_model)
    # When SGLang serves it with the hook's variable and flags
    server = LiveServer(model, tmp_path, tmp_path / "dumps")
    with running(server, "DeepSeek-V3 tiny (MLA, MoE), TP=1"):
        # Then SGLang runs its own DeepSeek classes, and the hook came up with SGLang's default
        # ids for 8 layers, found after init_attention_backends, recorded in one marker
        assert get_json(server.url, "/model_info")["architectures"] == ["DeepseekV3ForCausalLM"]
        [marker] = server.markers()
        info = json.loads(marker.read_text())
        assert info["layers_to_capture"] == [2, 4, 5]
        assert info["ids_known"] == "after init_attention_backends"
        assert (info["hidden_size"], info["model_path"]) == (64, str(model))
        assert "hsfarm dump hook active" in server.log.read_text(errors="replace")
