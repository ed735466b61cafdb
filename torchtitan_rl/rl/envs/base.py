"""What a multi-turn RL environment is: created per episode from a task problem, it gives the
episode's first messages and answers each of the policy's turns.

    class MyEnv:
        def __init__(self, problem):              # a torchtitan_rl.rl.tasks.Problem
            self.problem = problem
        def reset(self) -> list[dict]:            # the chat messages the first turn answers
            return list(self.problem.messages)
        def step(self, completion: str) -> EnvStep:
            ...                                   # EnvStep(observation, reward, done, correct)

An episode ends when ``step`` says ``done``, after ``rl.max_turns`` turns, or when it would not
fit ``training.seq_len``. Its reward is the sum of its steps' rewards; it is correct when its
last step says so (what pass@1 counts).
"""

import inspect
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torchtitan_rl.rl.tasks.task import Problem


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one turn of the policy."""

    observation: list[dict] | None
    """Chat messages appended before the policy's next turn (e.g. a ``tool`` message with a
    tool's output); None when the episode is done."""
    reward: float
    """This turn's reward; the episode's reward is the sum over its turns."""
    done: bool
    correct: bool = False
    """Whether the episode solved its problem (read from the last step)."""


@runtime_checkable
class Environment(Protocol):
    def reset(self) -> list[dict]: ...

    def step(self, completion: str) -> EnvStep: ...


def check_environment_class(cls: object, name: str) -> None:
    """``cls`` builds environments from a problem and has ``reset()`` and ``step(completion)``:
    a ValueError naming ``name`` and what is missing otherwise."""
    if not inspect.isclass(cls):
        raise ValueError(f"rl.env = {name!r} is not a class but a {type(cls).__name__}")
    missing = [method for method in ("reset", "step") if not callable(getattr(cls, method, None))]
    if missing:
        raise ValueError(
            f"rl.env = {name!r}: {cls.__name__} has no {' or '.join(f'{m}()' for m in missing)}; an environment "
            "needs reset() -> list of messages and step(completion: str) -> EnvStep"
        )
    try:
        inspect.signature(cls).bind(Problem((), "", ""))
    except TypeError as err:
        raise ValueError(f"rl.env = {name!r}: {cls.__name__}(problem) cannot be called with a problem: {err}") from None
    try:
        inspect.signature(cls.step).bind(None, "")
    except TypeError as err:
        raise ValueError(
            f"rl.env = {name!r}: {cls.__name__}.step(completion) does not take a completion: {err}"
        ) from None
