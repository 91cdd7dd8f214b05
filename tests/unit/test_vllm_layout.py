"""The vLLM hook's launch checks, which need no vLLM: the ids, the method, the layout."""

from __future__ import annotations

from engine_dump import contracts as c
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
    assert layout_problems(METHOD, [2, 3, 5, 6], 6, 1, 1, c.DTYPE_FP8, "0.32.0") == []
    problems = layout_problems("eagle3", [], 6, 3, 2, "fp16", "0.33.1")
    assert len(problems) == 4
    assert "vLLM 0.33.1: the hook is tested with 0.32.x only" in problems[0]
    assert f'"method":"{METHOD}"' in problems[1]
    assert "does not declare supports_aux_hidden_states_over_pp" in problems[2]
    assert "--pipeline-parallel-size 1" in problems[2]
    assert "HSFARM_VLLM_DUMP_DTYPE='fp16'" in problems[3]
    wrong = layout_problems(METHOD, [2, 3, 3, 6], 6, 2, 1, c.DTYPE_BF16, "0.32.0")
    assert "three distinct ids below the layer count 6 and 6 itself" in wrong[0]
    assert "num_speculative_tokens 2: set it to 1" in wrong[1]


def test_supported_versions_are_the_tested_minor_series() -> None:
    assert supported_version("0.32.0") and supported_version("0.32.3+cpu")
    assert not supported_version("0.31.2") and not supported_version("0.33.0")
    assert not supported_version("")


def test_pipeline_parallelism_is_refused_with_the_models_own_reason() -> None:
    # Given Kimi (DeepSeek-V3's class: no aux relay across stages) and Llama (it declares one)
    kimi = layout_problems(METHOD, [2, 30, 58, 61], 61, 1, 2, c.DTYPE_BF16, "0.32.0",
                           pp_carries_aux=False, arch="DeepseekV3ForCausalLM")
    llama = layout_problems(METHOD, [2, 3, 5, 6], 6, 1, 2, c.DTYPE_BF16, "0.32.0",
                            pp_carries_aux=True, arch="LlamaForCausalLM")
    # Then both are refused (no multi-stage run is tested), each naming why
    assert len(kimi) == 1 and "DeepseekV3ForCausalLM does not carry its aux" in kimi[0]
    assert len(llama) == 1 and "LlamaForCausalLM carries its aux states" in llama[0]
    assert all("--pipeline-parallel-size 1" in p for p in kimi + llama)

