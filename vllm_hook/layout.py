"""Which vLLM launches the hook serves, and what to change when it does not.

The hook reads each request's rows from the KV blocks vLLM's ``extract_hidden_states``
speculative method fills: four aux ids, the three the farm stores and the layer count L, whose
state (pre-norm in vLLM) the hook normalises into ``hidden_state``. vLLM sorts and
deduplicates the ids. Pure functions of the launch's values, so they run without vLLM; the
launch's two JSON flags are built here too.
Test: tests/unit/test_vllm_layout.py::test_layout_problems_name_the_fix
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine_dump import engines
from engine_dump.dumpfile import AUX_LAYERS, STORE_DTYPES
from engine_dump.fingerprint import default_layers_to_capture

# The vLLM releases the hook is tested with (the KV connector API is experimental): a minor
# series, by its leading "major.minor"
SUPPORTED_VLLM = ("0.32",)
CONNECTOR_NAME = "HsfarmConnector"
ENV_DUMP_DIR = engines.DUMP_DIR_VARIABLE[engines.VLLM]
ENV_DUMP_DTYPE = engines.DUMP_DTYPE_VARIABLE[engines.VLLM]
METHOD = "extract_hidden_states"
RID_PARAM = engines.VLLM_RID_PARAM  # the kv_transfer_params key the worker sends its rid in


class LayoutError(RuntimeError):
    """The server was launched with options the vLLM hook cannot handle correctly."""


def split_ids(ids: Sequence[int], num_layers: int) -> tuple[list[int], int] | None:
    """(the three aux ids the dump stores, the id of ``hidden_state``), as vLLM orders them;
    None when the ids are not three distinct ones below L and L itself."""
    found = sorted(set(int(i) for i in ids))
    if len(found) != AUX_LAYERS + 1 or found[-1] != num_layers or found[0] < 0:
        return None
    return found[:-1], found[-1]


def launch_ids(num_layers: int, aux: Sequence[int] | None = None) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` to launch with: ``aux`` (default: the farm's
    default capture ids) and L."""
    chosen = list(aux) if aux is not None else list(default_layers_to_capture(num_layers))
    return [*chosen, num_layers]


def speculative_config(ids: Sequence[int]) -> dict[str, Any]:
    """vLLM's ``--speculative-config``: ``extract_hidden_states`` with the aux ids and L."""
    return {"method": METHOD, "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}}


def kv_transfer_config() -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config``: the hook's connector, found by name (the
    ``vllm.general_plugins`` entry point registers it)."""
    return {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_producer"}


def as_flag(config: dict[str, Any]) -> str:
    """A config as one compact JSON word, as vLLM's flags take it."""
    return json.dumps(config, separators=(",", ":"))


def layout_problems(method: str | None, ids: Sequence[int], num_layers: int,
                    spec_tokens: int, pp_size: int, dtype: str, version: str,
                    pp_carries_aux: bool = False, arch: str = "this model") -> list[str]:
    """What is wrong with a launch for the hook, each with its fix; [] when it is served.
    ``pp_carries_aux``: the model class declares ``supports_aux_hidden_states_over_pp``."""
    problems = []
    if not supported_version(version):
        problems.append(f"vLLM {version or '(version unknown)'}: the hook is tested with "
                        f"{', '.join(v + '.x' for v in SUPPORTED_VLLM)} only (the KV connector "
                        f"API it uses is experimental); install vllm=={SUPPORTED_VLLM[-1]}.*")
    example = launch_ids(num_layers)
    if method != METHOD:
        problems.append(f"speculative method {method!r}: launch with --speculative-config "
                        f"'{as_flag(speculative_config(example))}'")
    elif split_ids(ids, num_layers) is None:
        problems.append(f"eagle_aux_hidden_state_layer_ids {list(ids)}: give three distinct "
                        f"ids below the layer count {num_layers} and {num_layers} itself "
                        f"(vLLM sorts and deduplicates them), e.g. {example}")
    if method == METHOD and spec_tokens != 1:
        problems.append(f"num_speculative_tokens {spec_tokens}: set it to 1")
    if pp_size != 1 and not pp_carries_aux:
        problems.append(f"pipeline parallel size {pp_size}: {arch} does not carry its aux "
                        "hidden states across pipeline stages in vLLM (it does not declare "
                        "supports_aux_hidden_states_over_pp; DeepSeek-V3 and Kimi do not), so "
                        "earlier stages' layers would be missing; launch with "
                        "--pipeline-parallel-size 1 (TP and DP instead)")
    elif pp_size != 1:
        problems.append(f"pipeline parallel size {pp_size}: {arch} carries its aux states "
                        "across stages, but vLLM 0.32 refuses extract_hidden_states under "
                        "pipeline parallelism (its drafter is not SupportsPP) and this hook "
                        "writes from one stage's blocks, untested across stages; launch with "
                        "--pipeline-parallel-size 1 (TP and DP instead)")
    if dtype not in STORE_DTYPES:
        problems.append(f"{ENV_DUMP_DTYPE}={dtype!r}: set it to one of "
                        f"{', '.join(STORE_DTYPES)} (or unset: bfloat16)")
    return problems


def supported_version(version: str) -> bool:
    """True for a vLLM release in the tested range (``SUPPORTED_VLLM``)."""
    parts = version.split("+", 1)[0].split(".")
    return ".".join(parts[:2]) in SUPPORTED_VLLM
