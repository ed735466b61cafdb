"""Recipes: what ``train.py`` runs, picked by ``job.recipe``."""

from collections.abc import Callable

from torchtitan_rl.config import JobConfig
from torchtitan_rl.recipes.dpo import DPORecipe
from torchtitan_rl.recipes.grpo import build_grpo
from torchtitan_rl.recipes.reward_model import RewardModelRecipe
from torchtitan_rl.recipes.service import build_service
from torchtitan_rl.recipes.sft import SFTRecipe

RECIPES: dict[str, Callable[[JobConfig], object]] = {
    "sft": SFTRecipe,
    "grpo": build_grpo,
    "service": build_service,
    "dpo": DPORecipe,
    "reward_model": RewardModelRecipe,
}
"""``job.recipe`` -> what builds this rank's part of the run from the config: an object with
``setup()``, ``train()`` and ``close()`` (a ``Recipe``; on a rollout rank, GRPO's
``RolloutWorker`` or the service's ``ServiceRolloutRank``). A new recipe registers here (and in ``job.recipe``'s choices)."""


def get_recipe(name: str) -> Callable[[JobConfig], object]:
    if name not in RECIPES:
        raise ValueError(f"job.recipe: unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name]
