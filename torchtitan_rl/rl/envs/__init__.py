"""Multi-turn environments: the built-ins by name, a user's by import path."""

import importlib

from torchtitan_rl.rl.envs.base import Environment, EnvStep, check_environment_class
from torchtitan_rl.rl.envs.calculator import CalculatorEnv
from torchtitan_rl.rl.envs.guess_number import GuessNumberEnv

ENVIRONMENTS: dict[str, type] = {"calculator": CalculatorEnv, "guess_number": GuessNumberEnv}
"""``rl.env`` names of the built-in environments."""

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "load_environment"]


def load_environment(name: str) -> type:
    """The environment class ``rl.env`` names: a built-in's name or ``package.module:ClassName``
    (imported now), checked against the protocol; a ValueError naming what is wrong."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module_name, sep, attribute = name.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"rl.env = {name!r}: not a built-in environment ({', '.join(sorted(ENVIRONMENTS))}) nor an import "
            "path 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"rl.env = {name!r}: cannot import {module_name!r}: {err}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"rl.env = {name!r}: module {module_name!r} has no {attribute!r}")
    cls = getattr(module, attribute)
    check_environment_class(cls, name)
    return cls
