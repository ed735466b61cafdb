"""A model cut into pipeline stages (``distributed.pipeline``), keeping every parameter's name.

Each stage is a copy of the model built on the meta device with only its layers; the first
keeps the token embeddings, the last the final norm and the head. ``layers`` is a
``ModuleDict`` keyed by the layer index, so a stage's parameters have the names they have in
the whole model: checkpoints and Hugging Face exports do not depend on the split.
"""

import copy

import torch
from torch import nn

from torchtitan_rl.models.lora import LoRASettings, add_adapters
from torchtitan_rl.models.registry import spec_for_args

# Modules outside the layers, by the stage that runs them (a vision-language model's vision
# tower and projector feed the first stage's embeddings).
FIRST_STAGE_MODULES = ("tok_embeddings", "vision_tower", "projector")
LAST_STAGE_MODULES = ("norm", "output", "score")


def stage_module(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A copy of the (meta) ``model`` that runs ``layers``, from the embeddings if ``first``,
    up to the head if ``last``."""
    stage = copy.deepcopy(model)
    _keep_layers(stage, set(layers))
    for name in () if first else FIRST_STAGE_MODULES:
        if hasattr(stage, name):
            setattr(stage, name, None)
    for name in () if last else LAST_STAGE_MODULES:
        if hasattr(stage, name):
            setattr(stage, name, None)
    return stage


def rank_module(model: nn.Module, stages: list[nn.Module]) -> nn.Module:
    """One module holding the modules of a rank's ``stages`` (built from ``model`` by
    ``stage_module``) under the whole model's names: what the optimizer, the gradient norm and
    checkpoints see. Never run: each stage runs itself. A single stage is its own."""
    if len(stages) == 1:
        return stages[0]
    union = copy.deepcopy(model)
    owners = {name: stage for stage in stages for name in stage.layers}
    _keep_layers(union, {int(name) for name in owners})
    for name, stage in owners.items():
        union.layers[name] = stage.layers[name]
    for name in (*FIRST_STAGE_MODULES, *LAST_STAGE_MODULES):
        if hasattr(union, name):
            held = [getattr(stage, name) for stage in stages if getattr(stage, name) is not None]
            setattr(union, name, held[0] if held else None)
    union.token_shard = stages[0].token_shard
    return union


def _keep_layers(model: nn.Module, keep: set[int]) -> None:
    for name in list(model.layers):
        if int(name) not in keep:
            del model.layers[name]


def whole_model(model: nn.Module, lora: LoRASettings | None = None) -> nn.Module:
    """The whole model, on the meta device, of which ``model`` holds pipeline stages (adapted
    like it with ``lora``); ``model`` itself when it is whole. Imports and exports check the
    names they read and write against it."""
    if getattr(model, "pipeline_stages", None) is None:
        return model
    spec = spec_for_args(model.args)
    with torch.device("meta"):
        whole = spec.model_cls(model.args)
    if lora is not None:
        add_adapters(whole, lora, spec.lora_targets)
    return whole
