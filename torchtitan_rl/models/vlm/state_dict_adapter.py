"""Key mapping between ``VLMModel`` and Hugging Face ``Mistral3ForConditionalGeneration``.

``to_hf`` writes the keys ``save_pretrained`` puts in the safetensors files (transformers 5
keeps the legacy on-disk layout of the shipped checkpoints):

    language_model.model.*         the Qwen3 decoder (the Qwen3 adapter's names, "model." prefix)
    language_model.lm_head.weight  the output head (absent when tied)
    vision_tower.*                 Pixtral (patch_conv, ln_pre, transformer.layers.N.*)
    multi_modal_projector.*        norm, patch_merger.merging_layer, linear_1, linear_2

``from_hf`` also accepts the in-memory names of transformers 5 (``model.language_model.*``,
``model.vision_tower.*``, ``model.multi_modal_projector.*``, ``lm_head.weight``), i.e. what
``model.state_dict()`` / ``named_parameters()`` of the HF model give. Shapes are identical on
both sides (the patch embedding keeps the Conv2d weight shape), so a loader can read slices
by key. Pure tensor-dict mapping: tensors are passed through untouched.
"""

import re

import torch

from torchtitan_rl.models.qwen3 import state_dict_adapter as qwen3_adapter
from torchtitan_rl.models.vlm.args import VLMModelArgs

_LM_PREFIX = "language_model."  # + a Qwen3ForCausalLM key

_VISION_TOP_TO_HF = {
    "vision_tower.patch_embedding.weight": "vision_tower.patch_conv.weight",
    "vision_tower.ln_pre.weight": "vision_tower.ln_pre.weight",
    "projector.norm.weight": "multi_modal_projector.norm.weight",
    "projector.merger.weight": "multi_modal_projector.patch_merger.merging_layer.weight",
    "projector.linear_1.weight": "multi_modal_projector.linear_1.weight",
    "projector.linear_1.bias": "multi_modal_projector.linear_1.bias",
    "projector.linear_2.weight": "multi_modal_projector.linear_2.weight",
    "projector.linear_2.bias": "multi_modal_projector.linear_2.bias",
}
_VISION_LAYER_TO_HF = {
    "attention.wq.weight": "attention.q_proj.weight",
    "attention.wk.weight": "attention.k_proj.weight",
    "attention.wv.weight": "attention.v_proj.weight",
    "attention.wo.weight": "attention.o_proj.weight",
    "attention_norm.weight": "attention_norm.weight",
    "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
    "feed_forward.w3.weight": "feed_forward.up_proj.weight",
    "feed_forward.w2.weight": "feed_forward.down_proj.weight",
    "ffn_norm.weight": "ffn_norm.weight",
}
_VISION_TOP_FROM_HF = {hf: ours for ours, hf in _VISION_TOP_TO_HF.items()}
_VISION_LAYER_FROM_HF = {hf: ours for ours, hf in _VISION_LAYER_TO_HF.items()}

_OUR_VISION_LAYER = re.compile(r"vision_tower\.layers\.(\d+)\.(.+)")
_HF_VISION_LAYER = re.compile(r"vision_tower\.transformer\.layers\.(\d+)\.(.+)")

# transformers 5 in-memory names -> on-disk names (the inverse of its "llava" load-time renaming).
_IN_MEMORY_TO_DISK = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our keys to the HF checkpoint's."""
    hf_state_dict, lm = {}, {}
    for key, tensor in state_dict.items():
        if key in _VISION_TOP_TO_HF:
            hf_state_dict[_VISION_TOP_TO_HF[key]] = tensor
        elif key.startswith(("vision_tower.", "projector.")):
            match = _OUR_VISION_LAYER.fullmatch(key)
            if match is None or match.group(2) not in _VISION_LAYER_TO_HF:
                raise ValueError(f"no HF name for VLM state dict key {key!r}")
            hf_state_dict[f"vision_tower.transformer.layers.{match.group(1)}.{_VISION_LAYER_TO_HF[match.group(2)]}"] = (
                tensor
            )
        else:
            lm[key] = tensor
    for key, tensor in qwen3_adapter.to_hf(lm).items():
        hf_state_dict[_LM_PREFIX + key] = tensor
    return hf_state_dict


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: VLMModelArgs) -> dict[str, torch.Tensor]:
    """Rename HF keys (on-disk or transformers 5 in-memory names) to ours, ready for
    ``VLMModel(args).load_state_dict``. Tied heads follow the Qwen3 adapter's rules."""
    state_dict, lm = {}, {}
    for key, tensor in hf_state_dict.items():
        key = _disk_name(key)
        if key.startswith(_LM_PREFIX):
            lm[key.removeprefix(_LM_PREFIX)] = tensor
        elif key in _VISION_TOP_FROM_HF:
            state_dict[_VISION_TOP_FROM_HF[key]] = tensor
        else:
            match = _HF_VISION_LAYER.fullmatch(key)
            if match is None or match.group(2) not in _VISION_LAYER_FROM_HF:
                raise ValueError(f"unexpected key {key!r} in HF Mistral3 state dict")
            layer = int(match.group(1))
            if layer >= args.vision.n_layers:
                vision = args.vision
                raise ValueError(
                    f"HF key {key!r} is for vision layer {layer}, but "
                    f"{'' if vision.source else 'vision '}{vision.field_names.value('n_layers', vision.n_layers)}"
                )
            state_dict[f"vision_tower.layers.{layer}.{_VISION_LAYER_FROM_HF[match.group(2)]}"] = tensor
    state_dict.update(qwen3_adapter.from_hf(lm, args))
    return state_dict


def in_memory_name(key: str) -> str:
    """The name transformers 5 gives the on-disk key ``key`` in the model it builds (what PEFT
    names adapters after): ``language_model.model.layers.0...`` -> ``model.language_model.layers.0...``."""
    for in_memory, disk in _IN_MEMORY_TO_DISK:
        if key.startswith(disk):
            return in_memory + key.removeprefix(disk)
    return key


def _disk_name(key: str) -> str:
    for in_memory, disk in _IN_MEMORY_TO_DISK:
        if key.startswith(in_memory):
            return disk + key.removeprefix(in_memory)
    return key
