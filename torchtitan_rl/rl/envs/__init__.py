"""Multi-turn environments: the built-ins by name, a user's by import path."""

from torchtitan_rl.rl.envs.base import Environment, EnvStep, check_environment_class
from torchtitan_rl.rl.envs.calculator import CalculatorEnv
from torchtitan_rl.rl.envs.guess_number import GuessNumberEnv
from torchtitan_rl.rl.plugins import import_object

ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnv, "guess_number": GuessNumberEnv}
"""``rl.env`` names of the built-in environments."""

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "load_environment"]


def load_environment(name: str) -> type:
    """The environment class ``rl.env`` names: a built-in's name or ``package.module:ClassName``
    (imported now), checked against the protocol; a ValueError naming what is wrong."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    cls = import_object("rl.env", name, f"environment ({', '.join(sorted(ENVIRONMENTS))})")
    check_environment_class(cls, name)
    return cls
