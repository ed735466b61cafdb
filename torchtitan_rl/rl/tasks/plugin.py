"""A user's reward function (``rl.reward_fn``) and whole tasks (``rl.task``), by import path.

A reward function is called as ``fn(problem, completion, stopped)``: the ``Problem`` (its
``messages``, ``answer``, ``source`` and, for rows of a dataset, every other column in
``extra``), the completion's text without its stop token, and whether the sampler stopped on a
stop token (False: cut at ``generation.max_new_tokens``). It returns

* a number: the reward; or
* a dict of named numbers: the reward's components, whose sum is the reward. Each is logged as
  ``rl/reward_<name>`` (the mean over the step's rollouts), so every call must return the same
  names.

A completion counts as correct (``rl/pass@1``, the groups' all-correct / all-wrong fractions,
evaluation's pass@k) when a ``correct`` component of 0 or 1 says so, else when its reward is at
least 1.

A task factory (``rl.task = "package.module:factory"``) is called once per rank at start-up,
with the keyword arguments among ``seed``, ``task_path``, ``num_train_prompts`` and
``num_eval_prompts`` that it declares, and returns an object with ``train_problems`` and
``eval_problems`` (sequences of ``Problem`` or of rows as in a dataset file), optionally
``spare_problems`` (answered problems in neither pool, for ``rl.sft_warmup_steps``), and a
``reward(problem, completion, stopped)`` method as above (``rl.reward_fn``, when set, replaces it).
"""

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchtitan_rl.data.chat import prompt_messages_problem
from torchtitan_rl.rl.plugins import (
    UserCodeError,
    accepted_keywords,
    calling_user_code,
    check_callable_with,
    import_object,
)
from torchtitan_rl.rl.tasks.dataset import row_problem
from torchtitan_rl.rl.tasks.rewards import OVERLONG_COMPONENT, Reward
from torchtitan_rl.rl.tasks.task import Problem

REWARD_CALL = "fn(problem, completion, stopped)"
CORRECT_COMPONENT = "correct"
CORRECT_AT = 1.0
"""Without a ``correct`` component, a completion whose reward is at least this is correct."""
# rl/reward_mean, rl/reward_std and the overlong penalty's rl/reward_overlong are tags of their own.
RESERVED_COMPONENTS = ("mean", "std", OVERLONG_COMPONENT)
_COMPONENT_NAME = re.compile(r"[A-Za-z0-9_]+")
FACTORY_KEYWORDS = ("seed", "task_path", "num_train_prompts", "num_eval_prompts")


def _sample_problem() -> Problem:
    return Problem(({"role": "user", "content": "?"},), "", "a signature check")


@dataclass
class RewardFunction:
    """A user's reward callable, whose results become ``Reward``s (checked at every call)."""

    key: str
    """The config key that named it, for errors (``rl.reward_fn`` or ``rl.task``)."""
    path: str
    fn: Callable[[Problem, str, bool], Any]
    names: tuple[str, ...] | None = field(default=None, init=False)
    """The components of the first dict result: every later result must have the same."""

    def __post_init__(self):
        check_callable_with(self.key, self.path, self.fn, REWARD_CALL, _sample_problem(), "", True)

    def __call__(self, problem: Problem, completion: str, stopped: bool) -> Reward:
        try:
            value = self.fn(problem, completion, stopped)
        except Exception as err:
            raise UserCodeError(
                f"{self.key} = {self.path!r} raised {type(err).__name__}: {err} on problem {problem.source} "
                f"(completion {completion[:200]!r}, stopped={stopped})"
            ) from err
        try:
            return self._reward(value)
        except ValueError as err:
            raise ValueError(f"{self.key} = {self.path!r} on problem {problem.source}: {err}") from None

    def _reward(self, value: Any) -> Reward:
        if isinstance(value, dict):
            return self._components_reward(value)
        total = _number(value, "the reward")
        return Reward(total=total, correct=total >= CORRECT_AT, components={})

    def _components_reward(self, value: dict) -> Reward:
        if not value:
            raise ValueError("returned an empty dict; return a number or a dict of named reward components")
        for name in value:
            if not isinstance(name, str) or _COMPONENT_NAME.fullmatch(name) is None:
                raise ValueError(f"component name {name!r} must be letters, digits and '_' (it becomes a tag)")
            if name in RESERVED_COMPONENTS:
                raise ValueError(f"component name {name!r} is taken by the tag rl/reward_{name}; rename it")
        names = tuple(sorted(value))
        if self.names is None:
            self.names = names
        elif names != self.names:
            raise ValueError(
                f"returned the components {list(names)}, but earlier calls returned {list(self.names)}; return "
                "the same names for every completion (each is logged as the mean over the step's rollouts)"
            )
        components = {name: _number(value[name], f"component {name!r}") for name in names}
        if CORRECT_COMPONENT in components:
            if components[CORRECT_COMPONENT] not in (0.0, 1.0):
                raise ValueError(
                    f"component {CORRECT_COMPONENT!r} is {value[CORRECT_COMPONENT]!r}; it says whether the "
                    "completion is correct, so it must be 0 or 1 (True or False)"
                )
            correct = components[CORRECT_COMPONENT] == 1.0
        else:
            correct = sum(components.values()) >= CORRECT_AT
        return Reward(total=sum(components.values()), correct=correct, components=components)


def _number(value: Any, what: str) -> float:
    if not isinstance(value, (bool, int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} is {value!r}; it must be a finite number (or a bool)")
    return float(value)


def load_reward_function(path: str) -> RewardFunction:
    """The reward function ``rl.reward_fn`` names, imported and checked now."""
    return RewardFunction("rl.reward_fn", path, import_object("rl.reward_fn", path))


@dataclass(frozen=True)
class PluginTask:
    """A task whose reward is a user's function: a factory's task, or any task with ``rl.reward_fn``."""

    name: str
    train_problems: tuple[Problem, ...]
    eval_problems: tuple[Problem, ...]
    reward_function: RewardFunction
    spare_problems: tuple[Problem, ...] = ()

    def reward(self, problem: Problem, completion: str, stopped: bool) -> Reward:
        return self.reward_function(problem, completion, stopped)


def load_task(
    path: str,
    *,
    task_path: str,
    num_train: int,
    num_eval: int,
    seed: int,
    reward_function: RewardFunction | None,
    builtins: str,
) -> PluginTask:
    """The task the factory ``rl.task = path`` makes, its problems and reward checked now;
    ``reward_function`` (``rl.reward_fn``) replaces the task's own reward when given."""
    factory = import_object("rl.task", path, builtins)
    offered = {"seed": seed, "task_path": task_path, "num_train_prompts": num_train, "num_eval_prompts": num_eval}
    if not callable(factory):
        raise ValueError(f"rl.task = {path!r} is a {type(factory).__name__}, not a task factory (a function)")
    accepted = accepted_keywords(factory, FACTORY_KEYWORDS)
    kwargs = offered if accepted is None else {k: v for k, v in offered.items() if k in accepted}
    check_callable_with("rl.task", path, factory, f"factory(<any of {', '.join(FACTORY_KEYWORDS)}>)", **kwargs)
    with calling_user_code(f"rl.task = {path!r}: the task factory"):
        made = factory(**kwargs)
    train = _problems(made, "train_problems", path, required=True)
    evaluation = _problems(made, "eval_problems", path, required=num_eval > 0)
    spare = _problems(made, "spare_problems", path, required=False)
    train_prompts = {p.prompt_key(): p for p in train}
    for problem in evaluation:
        if problem.prompt_key() in train_prompts:
            raise ValueError(
                f"rl.task = {path!r}: eval problem {problem.source} has the prompt of train problem "
                f"{train_prompts[problem.prompt_key()].source}; held-out prompts must never be trained on"
            )
    if reward_function is None:
        reward_function = RewardFunction("rl.task", f"{path} .reward", getattr(made, "reward", None))
    return PluginTask(path, train, evaluation, reward_function, spare)


def _problems(made: Any, attribute: str, path: str, required: bool) -> tuple[Problem, ...]:
    where = f"rl.task = {path!r}: the task's {attribute}"
    if not hasattr(made, attribute):
        if required:
            raise ValueError(f"{where} is missing; a task has train_problems, eval_problems and reward()")
        return ()
    items = getattr(made, attribute)
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise ValueError(f"{where} must be a sequence of problems, got {type(items).__name__}")
    if required and not items:
        raise ValueError(f"{where} is empty")
    problems = []
    for index, item in enumerate(items):
        source = f"{path} {attribute}[{index}]"
        try:
            problems.append(_problem(item, source))
        except ValueError as err:
            raise ValueError(f"{where}[{index}]: {err}") from None
    return tuple(problems)


def _problem(item: Any, source: str) -> Problem:
    if isinstance(item, dict):
        return row_problem(item, source, answer_match="exact", base_dir=None, answer_required=False)
    if not isinstance(item, Problem):
        raise ValueError(f"expected a Problem or a row dict, got {type(item).__name__}")
    problem = prompt_messages_problem(list(item.messages))
    if problem is not None:
        raise ValueError(problem)
    if not isinstance(item.answer, str):
        raise ValueError(f"its answer must be a string, got {item.answer!r}")
    return Problem(tuple(item.messages), item.answer, item.source or source, dict(item.extra))
