"""Problem pools of the built-in synthetic tasks, from the question generators the SFT rows use.

The train pool is the first ``num_train`` distinct questions drawn from ``seed``; the eval pool
the first ``num_eval`` distinct questions from an eval seed derived from ``seed`` that are not in
the train pool. Both are fixed by the seed alone, whatever the layout or the number of steps.
"""

import random

from torchtitan_rl.data.questions import QuestionGenerator
from torchtitan_rl.rl.tasks.task import Problem

# How many draws per wanted problem before concluding the task has too few distinct questions.
_DRAWS_PER_PROBLEM = 100


def _distinct_problems(
    task_name: str, split: str, generate: QuestionGenerator, rng: random.Random, count: int, excluded: set
) -> list[Problem]:
    problems: list[Problem] = []
    seen = set(excluded)
    for _ in range(_DRAWS_PER_PROBLEM * count + 1000):
        if len(problems) == count:
            break
        question, answer = generate(rng)
        problem = Problem(({"role": "user", "content": question},), answer, f"{task_name} {split} #{len(problems)}")
        if problem.prompt_key() not in seen:
            seen.add(problem.prompt_key())
            problems.append(problem)
    if len(problems) < count:
        raise ValueError(
            f"task {task_name!r} yielded only {len(problems)} distinct {split} problems of the {count} asked for "
            "(after excluding the train pool); lower rl.num_train_prompts or rl.num_eval_prompts"
        )
    return problems


def builtin_problem_pools(
    task_name: str,
    generate: QuestionGenerator,
    *,
    path: str,
    num_train: int,
    num_eval: int,
    seed: int,
    answer_match: str,
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """``(train, eval, spare)`` problems of the built-in task ``task_name``, whose questions
    ``generate`` draws (no spare ones: a generator can always draw more); rejects options it
    does not use."""
    if path:
        raise ValueError(
            f"rl.task_path: task {task_name!r} is built in and reads no file, but rl.task_path={path!r}; leave it empty"
        )
    if answer_match != "exact":
        raise ValueError(
            f"rl.answer_match: task {task_name!r} has exact answers, so it must be 'exact', got {answer_match!r}"
        )
    if num_train < 1:
        raise ValueError(f"rl.num_train_prompts: task {task_name!r} needs at least 1, got {num_train}")
    train = _distinct_problems(task_name, "train", generate, random.Random(seed), num_train, excluded=set())
    # A string seed gives a stream unrelated to every integer seed's, so eval never replays train draws.
    eval_rng = random.Random(f"eval-{seed}")
    train_prompts = {problem.prompt_key() for problem in train}
    return train, _distinct_problems(task_name, "eval", generate, eval_rng, num_eval, excluded=train_prompts), []
