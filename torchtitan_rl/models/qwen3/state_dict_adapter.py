"""Key mapping between this Qwen3 implementation and Hugging Face ``Qwen3ForCausalLM``.

Pure tensor-dict mapping; ``torchtitan_rl/hf_checkpoint.py`` reads and writes the files.
"""

import re

import torch

from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs

_TOP_LEVEL_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TO_HF = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in _TOP_LEVEL_TO_HF.items()}
_LAYER_FROM_HF = {hf: ours for ours, hf in _LAYER_TO_HF.items()}

_OUR_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our keys to HF's. Tensors are passed through untouched (no copies)."""
    hf_state_dict = {}
    for key, tensor in state_dict.items():
        if key in _TOP_LEVEL_TO_HF:
            hf_state_dict[_TOP_LEVEL_TO_HF[key]] = tensor
            continue
        match = _OUR_LAYER_KEY.fullmatch(key)
        if match is None or match.group(2) not in _LAYER_TO_HF:
            raise ValueError(f"no HF name for Qwen3 state dict key {key!r}")
        hf_state_dict[f"model.layers.{match.group(1)}.{_LAYER_TO_HF[match.group(2)]}"] = tensor
    return hf_state_dict


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: Qwen3ModelArgs
) -> dict[str, torch.Tensor]:
    """Rename HF keys to ours, ready for ``Qwen3Model(args).load_state_dict``.

    With tied embeddings ``output.weight`` is the embedding tensor (HF checkpoints of tied
    models usually omit ``lm_head.weight``; if present it is ignored).
    """
    state_dict = {}
    for key, tensor in hf_state_dict.items():
        if key in _TOP_LEVEL_FROM_HF:
            state_dict[_TOP_LEVEL_FROM_HF[key]] = tensor
            continue
        match = _HF_LAYER_KEY.fullmatch(key)
        if match is None or match.group(2) not in _LAYER_FROM_HF:
            raise ValueError(f"unexpected key {key!r} in HF Qwen3 state dict")
        layer = int(match.group(1))
        if layer >= args.n_layers:
            raise ValueError(f"HF key {key!r} is for layer {layer}, but n_layers={args.n_layers}")
        state_dict[f"layers.{layer}.{_LAYER_FROM_HF[match.group(2)]}"] = tensor

    if args.tie_embeddings:
        if "tok_embeddings.weight" in state_dict:
            state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    elif "output.weight" not in state_dict and "tok_embeddings.weight" in state_dict:
        raise ValueError(
            "HF state dict has no lm_head.weight but args.tie_embeddings is False; "
            "is this a tied checkpoint?"
        )
    return state_dict
