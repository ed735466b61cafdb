"""Verifiable RL tasks: prompt pools with reference answers, and rewards that check the answers.

``build_task`` is the one entry point; ``TASKS`` maps each task name to the builder of its
``(train, eval, spare)`` problem pools: the built-in text tasks, ``shapes`` (prompts with
images, for a vision-language policy) and ``jsonl`` (a user's files, optionally with images).
Reward formulas are in ``torchtitan_rl.rl.tasks.rewards``.
"""

from collections.abc import Callable
from functools import partial

from torchtitan_rl.data.questions import ENV_QUESTION_GENERATORS, QUESTION_GENERATORS
from torchtitan_rl.rl.tasks.builtin import builtin_problem_pools, generated_problem_pools
from torchtitan_rl.rl.tasks.jsonl import jsonl_problem_pools
from torchtitan_rl.rl.tasks.rewards import ANSWER_MATCHES, Reward, RewardSpec
from torchtitan_rl.rl.tasks.shapes import shapes_stream
from torchtitan_rl.rl.tasks.task import Problem, Task, VerifiableTask, answered_rows

ProblemPoolBuilder = Callable[..., tuple[list[Problem], list[Problem], list[Problem]]]
"""Called with keywords path, num_train, num_eval, seed, answer_match; rejects the ones it does not use."""

TASKS: dict[str, ProblemPoolBuilder] = {
    **{
        name: partial(builtin_problem_pools, name, generate)
        for name, generate in {**QUESTION_GENERATORS, **ENV_QUESTION_GENERATORS}.items()
    },
    "shapes": partial(generated_problem_pools, "shapes", shapes_stream),
    "jsonl": jsonl_problem_pools,
}


def build_task(
    name: str,
    *,
    path: str = "",
    num_train: int,
    num_eval: int,
    seed: int,
    partial_credit: float = 0.0,
    format_reward: float = 0.0,
    answer_match: str = "exact",
) -> Task:
    """The task ``name`` with ``num_train`` train and ``num_eval`` held-out problems drawn from ``seed``.

    ``path`` is the file or directory of the ``jsonl`` task; ``partial_credit``, ``format_reward``
    and ``answer_match`` set the reward (see ``rewards``). The arguments are the ``[rl]`` keys
    task, task_path, num_train_prompts, num_eval_prompts, ..., and errors name those keys.
    """
    if name not in TASKS:
        raise ValueError(f"rl.task: unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"rl.num_train_prompts={num_train} and rl.num_eval_prompts={num_eval} must be >= 0")
    reward_spec = RewardSpec(partial_credit=partial_credit, format_reward=format_reward, answer_match=answer_match)
    train, eval_problems, spare = TASKS[name](
        path=path, num_train=num_train, num_eval=num_eval, seed=seed, answer_match=answer_match
    )
    return VerifiableTask(name, tuple(train), tuple(eval_problems), reward_spec, tuple(spare))


__all__ = [
    "ANSWER_MATCHES",
    "TASKS",
    "Problem",
    "answered_rows",
    "Reward",
    "RewardSpec",
    "Task",
    "VerifiableTask",
    "build_task",
]
