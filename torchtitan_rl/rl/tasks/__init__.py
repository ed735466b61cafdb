"""Verifiable RL tasks: prompt pools with reference answers, and rewards that check the answers.

``build_task`` is the one entry point; ``TASKS`` maps each task name to the builder of its
``(train, eval, spare)`` problem pools: the built-in text tasks, ``shapes`` (prompts with
images, for a vision-language policy) and ``dataset`` (a user's files, optionally with images).
A task may also be a user's factory named by import path, and any task's verifier may be
replaced by a user's reward function (``plugin``). Reward formulas are in
``torchtitan_rl.rl.tasks.rewards``.
"""

from collections.abc import Callable
from functools import partial

from torchtitan_rl.data.questions import ENV_QUESTION_GENERATORS, QUESTION_GENERATORS
from torchtitan_rl.rl.plugins import is_import_path
from torchtitan_rl.rl.tasks.builtin import builtin_problem_pools, generated_problem_pools
from torchtitan_rl.rl.tasks.dataset import dataset_problem_pools
from torchtitan_rl.rl.tasks.plugin import PluginTask, load_reward_function, load_task
from torchtitan_rl.rl.tasks.rewards import ANSWER_MATCHES, Reward, RewardSpec
from torchtitan_rl.rl.tasks.shapes import shapes_stream
from torchtitan_rl.rl.tasks.task import Problem, Task, VerifiableTask, answered_rows

ProblemPoolBuilder = Callable[..., tuple[list[Problem], list[Problem], list[Problem]]]
"""Called with keywords path, eval_path, num_train, num_eval, seed, answer_match and
answer_required; rejects the options it does not use."""

GENERATED_TASKS: dict[str, ProblemPoolBuilder] = {
    **{
        name: partial(builtin_problem_pools, name, generate)
        for name, generate in {**QUESTION_GENERATORS, **ENV_QUESTION_GENERATORS}.items()
    },
    "shapes": partial(generated_problem_pools, "shapes", shapes_stream),
}
"""Built-in tasks that draw fresh problems from seeded streams (their warm-up draws more)."""
TASKS: dict[str, ProblemPoolBuilder] = {**GENERATED_TASKS, "dataset": dataset_problem_pools}


def check_task_name(name: str) -> None:
    """A ValueError naming ``rl.task`` unless ``name`` is a task of ``TASKS`` or an import path."""
    if name not in TASKS and not is_import_path(name):
        raise ValueError(
            f"rl.task: unknown task {name!r}; valid tasks: {sorted(TASKS)}, or a task factory 'package.module:name'"
        )


def check_task_settings(rl) -> None:
    """Which task keys of the ``[rl]`` section ``rl`` go with which task: ``rl.task`` names a task,
    ``dataset`` reads the files of ``rl.task_path`` (and ``rl.eval_task_path``) and is the one
    task whose verifier takes ``rl.answer_match``; a factory may read ``rl.task_path``."""
    check_task_name(rl.task)
    if rl.task == "dataset" and not rl.task_path:
        raise ValueError(
            "rl.task_path: set it to the .jsonl, .json or .parquet file (or directory) of rl.task = 'dataset'"
        )
    if rl.task_path and rl.task != "dataset" and not is_import_path(rl.task):
        raise ValueError(
            f"rl.task_path: only used with rl.task = 'dataset' or a task factory, but rl.task = {rl.task!r}"
        )
    if rl.eval_task_path and rl.task != "dataset":
        raise ValueError(f"rl.eval_task_path: only used with rl.task = 'dataset', but rl.task = {rl.task!r}")
    # With rl.reward_fn the config rejects any verifier key.
    if not rl.reward_fn and rl.answer_match != type(rl)().answer_match and rl.task != "dataset":
        raise ValueError(f"rl.answer_match: only used with rl.task = 'dataset' ({rl.task!r} matches exactly)")


def build_task(
    name: str,
    *,
    path: str = "",
    eval_path: str = "",
    num_train: int,
    num_eval: int,
    seed: int,
    partial_credit: float = 0.0,
    format_reward: float = 0.0,
    answer_match: str = "exact",
    reward_fn: str = "",
    answers_required: bool = True,
) -> Task:
    """The task ``name`` with ``num_train`` train and ``num_eval`` held-out problems drawn from ``seed``.

    ``name`` is one of ``TASKS`` or a factory's import path (``plugin.load_task``). ``path`` and
    ``eval_path`` are the files of the ``dataset`` task (or ``path`` is offered to a factory);
    ``partial_credit``, ``format_reward`` and ``answer_match`` set the built-in verifier (see
    ``rewards``), which the function ``reward_fn`` names replaces. Without ``answers_required``
    (a reward model rewards alone) a dataset row may lack its answer. The arguments are the ``[rl]``
    keys task, task_path, eval_task_path, num_train_prompts, num_eval_prompts, ..., and errors
    name those keys.
    """
    check_task_name(name)
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"rl.num_train_prompts={num_train} and rl.num_eval_prompts={num_eval} must be >= 0")
    reward_function = load_reward_function(reward_fn) if reward_fn else None
    # Checked before any file is read.
    reward_spec = RewardSpec(partial_credit=partial_credit, format_reward=format_reward, answer_match=answer_match)
    if is_import_path(name):
        if eval_path:
            raise ValueError(
                f"rl.eval_task_path: only used with rl.task = 'dataset'; the factory {name!r} makes the eval problems"
            )
        return load_task(
            name,
            task_path=path,
            num_train=num_train,
            num_eval=num_eval,
            seed=seed,
            reward_function=reward_function,
            builtins=f"task ({', '.join(sorted(TASKS))})",
        )
    train, eval_problems, spare = TASKS[name](
        path=path,
        eval_path=eval_path,
        num_train=num_train,
        num_eval=num_eval,
        seed=seed,
        answer_match=answer_match,
        answer_required=reward_function is None and answers_required,
    )
    if reward_function is not None:
        return PluginTask(name, tuple(train), tuple(eval_problems), reward_function, tuple(spare))
    return VerifiableTask(name, tuple(train), tuple(eval_problems), reward_spec, tuple(spare))


__all__ = [
    "ANSWER_MATCHES",
    "GENERATED_TASKS",
    "TASKS",
    "PluginTask",
    "Problem",
    "answered_rows",
    "Reward",
    "RewardSpec",
    "Task",
    "VerifiableTask",
    "build_task",
    "check_task_name",
    "check_task_settings",
]


# Problems drawn for rl.num_train_prompts = 0 from a task that generates them.
_BUILTIN_POOL_SIZE = 1000


def task_from_config(rl, seed: int, num_eval: int) -> Task:
    """``build_task`` from a config's ``[rl]`` section, holding out ``num_eval`` problems."""
    generated = rl.task in GENERATED_TASKS
    return build_task(
        rl.task,
        path=rl.task_path,
        eval_path=rl.eval_task_path,
        num_train=rl.num_train_prompts or (_BUILTIN_POOL_SIZE if generated else 0),
        num_eval=num_eval,
        seed=seed,
        partial_credit=rl.partial_credit,
        format_reward=rl.format_reward,
        answer_match=rl.answer_match,
        reward_fn=rl.reward_fn,
        answers_required=not rl.reward_model_alone,
    )
