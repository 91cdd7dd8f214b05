"""``python -m vllm_hook launch-args``: the flags a vLLM server needs for the hook.

From the model's config.json (its layer count L; a multimodal wrapper's ``text_config``) and
the farm's three aux ids (default: ``launch_ids``'s), the ``--speculative-config`` of
``extract_hidden_states`` and the ``--kv-transfer-config`` naming ``HsfarmConnector``, one
word a line on stdout for ops/launch-vllm.sh; what was chosen, or why not, on stderr.
Test: tests/unit/test_vllm_layout.py::test_launch_args_are_the_flags_the_hook_checks_for
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_hook.layout import (
    CONNECTOR_NAME,
    as_flag,
    kv_transfer_config,
    launch_ids,
    speculative_config,
    split_ids,
)


def num_layers(model_path: Path) -> int:
    """L of the model's language part; ValueError with the reason when it cannot be read."""
    try:
        cfg = json.loads((model_path / "config.json").read_text())
        inner = cfg.get("text_config")  # multimodal wrappers (Kimi-K2.5)
        return int((inner if isinstance(inner, dict) else cfg)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{model_path}/config.json gives no num_hidden_layers ({e})") from e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_hook launch-args",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model-path", type=Path, required=True)
    p.add_argument("--layers", type=int, nargs="*", default=None,
                   help="the three aux ids (FARM_LAYERS_TO_CAPTURE); default 2, L//2, L-3")
    args = p.parse_args(argv)
    try:
        layers = num_layers(args.model_path)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    ids = launch_ids(layers, args.layers or None)
    if len(ids) != 4 or split_ids(ids, layers) is None:
        print(f"aux ids {ids[:-1]}: give three distinct ids below the layer count {layers}",
              file=sys.stderr)
        return 1
    for word in ("--speculative-config", as_flag(speculative_config(ids)),
                 "--kv-transfer-config", as_flag(kv_transfer_config())):
        print(word)
    print(f"hook layout: aux ids {ids[:-1]} and L = {layers} (hidden_state: the final norm of "
          f"id {layers}), {CONNECTOR_NAME} as kv_producer", file=sys.stderr)
    return 0
