"""Recipes: what ``train.py`` runs, picked by ``job.recipe``."""

from torchtitan_rl.recipes.base import Recipe
from torchtitan_rl.recipes.grpo import GRPORecipe
from torchtitan_rl.recipes.sft import SFTRecipe

RECIPES: dict[str, type[Recipe]] = {"sft": SFTRecipe, "grpo": GRPORecipe}
"""``job.recipe`` -> the recipe class; a new recipe registers here (and in ``job.recipe``'s choices)."""


def get_recipe(name: str) -> type[Recipe]:
    if name not in RECIPES:
        raise ValueError(f"job.recipe: unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[name]
