"""What each tensor of a final file is, in words a trainer's author can check: the manifest's
``tensors`` entry.

Derived from the fingerprint (layer ids and their convention), so it is not part of the
fingerprint's identity: recording it changes no run's id.
"""

from __future__ import annotations

from engine_dump.dumpfile import (
    DTYPE_BF16,
    FP8_BLOCK,
    T_AUX,
    T_AUX_SCALE,
    T_HIDDEN,
    T_HIDDEN_SCALE,
    T_INPUT_IDS,
    T_LOSS_MASK,
    fp8_blocks,
)
from engine_dump.fingerprint import Fingerprint


def tensor_semantics(fp: Fingerprint) -> dict[str, object]:
    """The manifest's ``tensors`` entry for a run with fingerprint ``fp``."""
    sglang_ids = list(fp.layers_to_capture)
    output_ids = [i - 1 for i in sglang_ids]
    kind = "bf16" if fp.dtype == DTYPE_BF16 else "float8 e4m3fn"
    nb, block = fp8_blocks(fp.hidden_size), FP8_BLOCK
    scales = {} if fp.dtype == DTYPE_BF16 else {
        T_HIDDEN_SCALE: f"float32 [T, {nb}]: hidden_state's scales, one per block of {block} "
                        "values of a token's row (the last block may be shorter): value = "
                        "float(e4m3) * scale, scale = max|block| / 448; a file whose scales "
                        "are [T, 1] (written before the blocks) has one per row",
        T_AUX_SCALE: f"float32 [T, {3 * nb}]: aux_hidden_state's scales, {nb} per layer, "
                     f"layer by layer, as hidden_state's (columns i*{nb} to (i+1)*{nb} - 1 "
                     "scale the i-th layer); a file whose scales are [T, 3] has one per "
                     "token per layer"}
    return {
        T_INPUT_IDS: "int64 [T]: the token ids sent to the server (chat template applied)",
        T_LOSS_MASK: "int64 [T]: 1 on tokens an assistant message adds (content and end of "
                     "turn), else 0; not shifted",
        T_HIDDEN: f"{kind} [T, {fp.hidden_size}]: the final hidden state AFTER the model's final "
                  "norm (the LM head's input); final_norm.safetensors holds the norm weight, "
                  "so hidden_state / weight is a pre-norm state the same norm maps back",
        T_AUX: f"{kind} [T, {3 * fp.hidden_size}]: three states concatenated in this order: the "
               f"inputs of layers {sglang_ids} (SGLang's convention, HF hidden_states[i]) = "
               f"the outputs of layers {output_ids} (0-based, Model-Optimizer's convention)",
        "aux_layers_sglang": sglang_ids,
        "aux_layers_output_0based": output_ids,
        "hidden_state_norm": "post",
        "min_tokens": 2,
        **scales,
    }
