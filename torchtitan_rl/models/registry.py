"""Model registry: each family's args and flavors, model class, parallelize function and
Hugging Face adapter (torchtitan's train spec), so the trainer builds ``[model] name`` with
no per-family branches."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchtitan_rl.models.qwen3 import state_dict_adapter as qwen3_adapter
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan_rl.models.qwen3.model import LORA_TARGETS, Qwen3Model
from torchtitan_rl.models.qwen3.parallelize import parallelize_qwen3
from torchtitan_rl.models.vlm import state_dict_adapter as vlm_adapter
from torchtitan_rl.models.vlm.args import VLMModelArgs, vlm_flavors
from torchtitan_rl.models.vlm.model import VLM_LORA_TARGETS, VLMModel
from torchtitan_rl.models.vlm.parallelize import parallelize_vlm


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args_cls: type  # from_hf_config / to_hf_config / from_dict
    flavors: dict[str, Any]
    model_cls: type[nn.Module]
    # (model, parallel_dims, param_dtype, reduce_dtype) -> None, in place
    parallelize: Callable[..., None]
    # Our state-dict keys -> Hugging Face's, and back (from_hf(hf_state_dict, args)).
    to_hf: Callable[[dict], dict]
    from_hf: Callable[[dict, Any], dict]
    hf_model_types: tuple[str, ...]  # the ``model_type``s of the family's HF config.json
    # ``lora.target_modules`` names -> regular expression of the full module names each adapts.
    lora_targets: dict[str, str]
    # (our key, size of dim 0) -> the HF keys of its dim-0 slices when HF stores a stacked
    # parameter (MoE experts) as one tensor per slice, else None.
    stacked_hf_keys: Callable[[str, int], list[str] | None] = lambda key, size: None
    # An HF file key -> the name of that tensor in the model transformers builds from the files
    # (the names PEFT gives adapters), where the two differ.
    hf_in_memory_name: Callable[[str], str] = lambda key: key
    takes_images: bool = False


MODEL_SPECS: dict[str, ModelSpec] = {
    "qwen3": ModelSpec(
        "qwen3",
        Qwen3ModelArgs,
        qwen3_flavors,
        Qwen3Model,
        parallelize_qwen3,
        qwen3_adapter.to_hf,
        qwen3_adapter.from_hf,
        ("qwen3", "qwen3_moe"),
        LORA_TARGETS,
        stacked_hf_keys=lambda key, size: (
            qwen3_adapter.expert_hf_keys(key, size) if qwen3_adapter.is_expert_key(key) else None
        ),
    ),
    "vlm": ModelSpec(
        "vlm",
        VLMModelArgs,
        vlm_flavors,
        VLMModel,
        parallelize_vlm,
        vlm_adapter.to_hf,
        vlm_adapter.from_hf,
        ("mistral3",),
        VLM_LORA_TARGETS,
        hf_in_memory_name=vlm_adapter.in_memory_name,
        takes_images=True,
    ),
}


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODEL_SPECS:
        raise ValueError(f"unknown model.name {name!r}; valid: {', '.join(MODEL_SPECS)}")
    return MODEL_SPECS[name]


def spec_for_args(args) -> ModelSpec:
    """The family whose args class ``args`` is (exactly: a VLM's args extend Qwen3's)."""
    return next(spec for spec in MODEL_SPECS.values() if type(args) is spec.args_cls)


def spec_for_hf_config(config: dict, source: str) -> ModelSpec:
    """The family that reads an HF ``config.json`` of this ``model_type``."""
    model_type = config.get("model_type")
    for spec in MODEL_SPECS.values():
        if model_type in spec.hf_model_types:
            return spec
    known = ", ".join(repr(t) for spec in MODEL_SPECS.values() for t in spec.hf_model_types)
    raise ValueError(f"{source}: model_type is {model_type!r}; supported: {known}")
