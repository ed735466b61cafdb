"""The frozen reference policy of a run (GRPO's KL penalty, DPO's and IPO's log-ratios): the
policy the run starts from.

A full model: a copy of the policy's model, sharded like it, saved in checkpoints (a resumed run
restores it; a fresh one copies the policy into it once the start weights are loaded). Under
LoRA: the policy's own model with its adapters off, no second copy; it is the starting policy
only while every adapter adds nothing, which a fresh run checks.
"""

import torch

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.utils import full_tensor
from torchtitan_rl.engine import Engine
from torchtitan_rl.models.lora import adapters_disabled, lora_modules
from torchtitan_rl.recipes.base import REDUCE_DTYPES, Recipe, build_model, compute_dtype, lora_settings, pipeline_plan


class ReferencePolicy:
    """``recipe``'s reference policy; ``remedy`` tells a user starting LoRA from trained
    adapters what to change (the keys that asked for a reference)."""

    def __init__(self, recipe: Recipe, remedy: str):
        self.engine, self.remedy = recipe.engine, remedy
        self.copy = None if lora_settings(recipe.job_config) is not None else _frozen_copy(recipe)

    def checkpointed(self) -> dict[str, torch.nn.Module]:
        """The models a checkpoint saves besides the policy."""
        return {} if self.copy is None else {"reference": self.copy.model}

    def start(self) -> None:
        """On a fresh run, once the policy holds its start weights: the reference := the policy
        (with LoRA: checked to be it). Collective over the training ranks."""
        if self.copy is None:
            check_adapters_add_nothing(self.engine.model, self.remedy)
            return
        with torch.no_grad():
            for ref, param in zip(self.copy.model.parameters(), self.engine.model.parameters()):
                ref.copy_(param)

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """The reference's per-token log-probs of ``samples`` (collective, like ``Engine.forward``)."""
        if self.copy is not None:
            return self.copy.forward(samples).logprobs
        return base_logprobs(self.engine, samples)


def _frozen_copy(recipe: Recipe) -> Engine:
    """A frozen model like the policy's, sharded like it; used only through ``Engine.forward``."""
    cfg = recipe.job_config
    model = build_model(
        recipe.model_args,
        parallel_dims=recipe.parallel_dims,
        device=recipe.device,
        seed=cfg.debug.seed,
        param_dtype=compute_dtype(cfg, recipe.device),
        reduce_dtype=REDUCE_DTYPES[cfg.training.mixed_precision_reduce],
        pipeline=pipeline_plan(cfg, recipe.parallel_dims, recipe.model_args.n_layers),
    )
    model.requires_grad_(False)
    return recipe.engine.over(model)


def base_logprobs(engine: Engine, samples: list[Sample]) -> list[torch.Tensor]:
    """The reference policy's log-probs under LoRA: the policy's model with its adapters off."""
    with adapters_disabled(engine.model):
        return engine.forward(samples).logprobs


def check_adapters_add_nothing(model: torch.nn.Module, remedy: str) -> None:
    """The base is the reference (``base_logprobs``) only when it is the policy the run starts
    from: every adapter's B is zero, as initialized. Not so when the run starts from trained
    adapters. Collective over the training ranks (a sharded B is gathered)."""
    trained = [name for name, m in lora_modules(model).items() if bool(full_tensor(m.lora_b.weight).any())]
    if trained:
        raise ValueError(
            f"lora.enable with a reference policy: the run starts from trained adapters ({trained[0]} and "
            f"{len(trained) - 1} more), so the reference (the base, adapters off) is not the policy the run starts "
            f"from; start from the merged weights (lora.export_merged) with fresh adapters, or {remedy}"
        )
