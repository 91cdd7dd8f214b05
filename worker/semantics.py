"""What each tensor of a final file is, in words a trainer's author can check: the manifest's
``tensors`` entry.

Derived from the fingerprint (layer ids and their convention), so it is not part of the
fingerprint's identity: recording it changes no run's id.
"""

from __future__ import annotations

from sglang_patch import contracts as c


def tensor_semantics(fp: c.Fingerprint) -> dict[str, object]:
    """The manifest's ``tensors`` entry for a run with fingerprint ``fp``."""
    sglang_ids = list(fp.layers_to_capture)
    output_ids = [i - 1 for i in sglang_ids]
    kind = "bf16" if fp.dtype == c.DTYPE_BF16 else "float8 e4m3fn"
    scales = {} if fp.dtype == c.DTYPE_BF16 else {
        c.T_HIDDEN_SCALE: "float32 [T, 1]: hidden_state's scale per token: value = "
                          "float(e4m3) * scale, scale = max|row| / 448",
        c.T_AUX_SCALE: "float32 [T, 3]: aux_hidden_state's scale per token, one column per "
                       "layer (column i scales the i-th block of the hidden size)"}
    return {
        c.T_INPUT_IDS: "int64 [T]: the token ids sent to the server (chat template applied)",
        c.T_LOSS_MASK: "int64 [T]: 1 on tokens an assistant message adds (content and end of "
                       "turn), else 0; not shifted",
        c.T_HIDDEN: f"{kind} [T, {fp.hidden_size}]: the final hidden state AFTER the model's final "
                    "norm (the LM head's input); final_norm.safetensors holds the norm weight, "
                    "so hidden_state / weight is a pre-norm state the same norm maps back",
        c.T_AUX: f"{kind} [T, {3 * fp.hidden_size}]: three states concatenated in this order: the "
                 f"inputs of layers {sglang_ids} (SGLang's convention, HF hidden_states[i]) = "
                 f"the outputs of layers {output_ids} (0-based, Model-Optimizer's convention)",
        "aux_layers_sglang": sglang_ids,
        "aux_layers_output_0based": output_ids,
        "hidden_state_norm": "post",
        "min_tokens": 2,
        **scales,
    }
