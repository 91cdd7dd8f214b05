"""The vLLM hook's launch checks and flags, which need no vLLM: the ids, the method, the layout,
``python -m vllm_hook launch-args`` and the dump dir commands."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from functools import partial
from pathlib import Path

from engine_dump.dumpfile import DTYPE_BF16, DTYPE_FP8
from vllm_hook import launch
from vllm_hook.layout import (
    METHOD,
    launch_ids,
    layout_problems,
    split_ids,
    supported_version,
)


def test_ids_split_into_the_three_stored_and_the_normed_last() -> None:
    # vLLM sorts and deduplicates the ids: the order given does not matter, a duplicate does
    assert split_ids([6, 2, 3, 5], 6) == ([2, 3, 5], 6)
    assert split_ids([2, 3, 3, 6], 6) is None  # (2, 3, 3): vLLM keeps three ids
    assert split_ids([2, 3, 5], 6) is None  # no L: hidden_state cannot be computed
    assert split_ids([2, 3, 5, 7], 6) is None
    assert launch_ids(61) == [2, 30, 58, 61]  # Kimi-K2.5: the farm's default ids and L
    assert launch_ids(6, [2, 3, 5]) == [2, 3, 5, 6]


def test_layout_problems_name_the_fix() -> None:
    assert layout_problems(METHOD, [2, 3, 5, 6], 6, 1, 1, DTYPE_FP8, "0.32.0") == []
    problems = layout_problems("eagle3", [], 6, 3, 2, "fp16", "0.33.1")
    assert len(problems) == 4
    assert "vLLM 0.33.1: the hook is tested with 0.32.x only" in problems[0]
    assert f'"method":"{METHOD}"' in problems[1]
    assert "does not declare supports_aux_hidden_states_over_pp" in problems[2]
    assert "--pipeline-parallel-size 1" in problems[2]
    assert "HSFARM_VLLM_DUMP_DTYPE='fp16'" in problems[3]
    wrong = layout_problems(METHOD, [2, 3, 3, 6], 6, 2, 1, DTYPE_BF16, "0.32.0")
    assert "three distinct ids below the layer count 6 and 6 itself" in wrong[0]
    assert "num_speculative_tokens 2: set it to 1" in wrong[1]


def test_supported_versions_are_the_tested_minor_series() -> None:
    assert supported_version("0.32.0") and supported_version("0.32.3+cpu")
    assert not supported_version("0.31.2") and not supported_version("0.33.0")
    assert not supported_version("")


def test_pipeline_parallelism_is_refused_with_the_models_own_reason() -> None:
    # Given Kimi (DeepSeek-V3's class: no aux relay across stages) and Llama (it declares one)
    kimi = layout_problems(METHOD, [2, 30, 58, 61], 61, 1, 2, DTYPE_BF16, "0.32.0",
                           pp_carries_aux=False, arch="DeepseekV3ForCausalLM")
    llama = layout_problems(METHOD, [2, 3, 5, 6], 6, 1, 2, DTYPE_BF16, "0.32.0",
                            pp_carries_aux=True, arch="LlamaForCausalLM")
    # Then both are refused (no multi-stage run is tested), each naming why
    assert len(kimi) == 1 and "DeepseekV3ForCausalLM does not carry its aux" in kimi[0]
    assert len(llama) == 1 and "LlamaForCausalLM carries its aux states" in llama[0]
    assert all("--pipeline-parallel-size 1" in p for p in kimi + llama)


def test_launch_args_are_the_flags_the_hook_checks_for(tmp_path: Path) -> None:
    # Given Kimi-K2.5's config shape: 61 layers in a multimodal wrapper's text_config
    model = tmp_path / "kimi"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 61}}))
    # When launch-args reads it, with the default ids and with the farm's own
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert launch.main(["--model-path", str(model)]) == 0
    flags = out.getvalue().splitlines()
    # Then the flags are extract_hidden_states with [2, 30, 58] and L = 61, and the connector,
    # and the hook's own check finds nothing wrong with that launch
    assert flags[0::2] == ["--speculative-config", "--kv-transfer-config"]
    spec, kv = json.loads(flags[1]), json.loads(flags[3])
    ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [2, 30, 58, 61] and kv == {"kv_connector": "HsfarmConnector",
                                             "kv_role": "kv_producer"}
    assert layout_problems(spec["method"], ids, 61, spec["num_speculative_tokens"], 1,
                           DTYPE_BF16, "0.32.0") == []
    assert "aux ids [2, 30, 58] and L = 61" in err.getvalue()
    # And ids the hook would refuse, or a config without a layer count, are refused here
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        assert launch.main(["--model-path", str(model), "--layers", "2", "2", "58"]) == 1
        assert launch.main(["--model-path", str(tmp_path)]) == 1


def test_vllm_hook_cli_has_the_dump_dir_commands_of_the_sglang_hook(tmp_path: Path) -> None:
    # Given a dump dir that does not exist yet
    run = partial(subprocess.run, capture_output=True, text=True, timeout=60)
    base = [sys.executable, "-m", "vllm_hook"]
    # When the hook's CLI is asked about it, and for help
    owner = run([*base, "dumpdir", "--dump-dir", str(tmp_path / "d")])
    found = run([*base, "markers", "--dump-dir", str(tmp_path)])
    usage = run([*base, "--help"])
    bad = run([*base, "markers"])
    # Then it answers as sglang_patch's does, under its own name
    assert owner.returncode == 0 and "does not exist yet" in owner.stdout
    assert found.returncode == 0 and "ready markers in" in found.stdout
    for sub in ("verify", "markers", "dumpdir", "launch-args"):
        assert f"python -m vllm_hook {sub}" in usage.stdout
    assert bad.returncode == 2 and "usage: python -m vllm_hook markers" in bad.stderr
