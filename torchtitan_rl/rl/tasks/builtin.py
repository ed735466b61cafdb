"""Problem pools of the built-in synthetic tasks, drawn from seeded streams of candidate problems.

The train pool is the first ``num_train`` distinct candidates of the ``train`` stream of
``seed``; the eval pool the first ``num_eval`` distinct candidates of the ``eval`` stream that
are not in the train pool. Both are fixed by the seed alone, whatever the layout or the number
of steps. The text tasks' candidates are the questions the SFT rows use.
"""

import random
from collections.abc import Callable, Iterator

from torchtitan_rl.data.questions import QuestionGenerator
from torchtitan_rl.rl.tasks.task import Problem

Candidate = tuple[tuple[dict, ...], str]
"""A problem before it has a place in a pool: its prompt messages and its answer."""
CandidateStreams = Callable[[int, str], Iterator[Candidate]]
"""``(seed, split)`` → the endless stream of the ``split`` ("train" or "eval") candidates of ``seed``."""

# How many draws per wanted problem before concluding the task has too few distinct questions.
_DRAWS_PER_PROBLEM = 100


def _distinct_problems(
    task_name: str, split: str, candidates: Iterator[Candidate], count: int, excluded: set
) -> list[Problem]:
    problems: list[Problem] = []
    seen = set(excluded)
    for _ in range(_DRAWS_PER_PROBLEM * count + 1000):
        if len(problems) == count:
            break
        messages, answer = next(candidates)
        problem = Problem(messages, answer, f"{task_name} {split} #{len(problems)}")
        if problem.prompt_key() not in seen:
            seen.add(problem.prompt_key())
            problems.append(problem)
    if len(problems) < count:
        raise ValueError(
            f"task {task_name!r} yielded only {len(problems)} distinct {split} problems of the {count} asked for "
            "(after excluding the train pool); lower rl.num_train_prompts or rl.num_eval_prompts"
        )
    return problems


def generated_problem_pools(
    task_name: str,
    streams: CandidateStreams,
    *,
    path: str,
    eval_path: str,
    num_train: int,
    num_eval: int,
    seed: int,
    answer_match: str,
    answer_required: bool,
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """``(train, eval, spare)`` problems of the built-in task ``task_name``, whose candidates
    ``streams`` draws (no spare ones: a stream can always draw more); rejects options it does
    not use. Every problem has an answer, whatever ``answer_required``."""
    for key, value in (("rl.task_path", path), ("rl.eval_task_path", eval_path)):
        if value:
            raise ValueError(
                f"{key}: task {task_name!r} is built in and reads no file, but {key}={value!r}; leave it empty"
            )
    if answer_match != "exact":
        raise ValueError(
            f"rl.answer_match: task {task_name!r} has exact answers, so it must be 'exact', got {answer_match!r}"
        )
    if num_train < 1:
        raise ValueError(f"rl.num_train_prompts: task {task_name!r} needs at least 1, got {num_train}")
    train = _distinct_problems(task_name, "train", streams(seed, "train"), num_train, excluded=set())
    train_prompts = {problem.prompt_key() for problem in train}
    eval_problems = _distinct_problems(task_name, "eval", streams(seed, "eval"), num_eval, excluded=train_prompts)
    return train, eval_problems, []


def _question_stream(generate: QuestionGenerator, seed: int, split: str) -> Iterator[Candidate]:
    # The train stream is the SFT rows' stream of the same seed. A string seed gives a stream
    # unrelated to every integer seed's, so eval never replays train draws.
    rng = random.Random(seed if split == "train" else f"eval-{seed}")
    while True:
        question, answer = generate(rng)
        yield ({"role": "user", "content": question},), answer


def builtin_problem_pools(
    task_name: str, generate: QuestionGenerator, **options
) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """``generated_problem_pools`` of a text task whose questions ``generate`` draws."""
    return generated_problem_pools(task_name, lambda seed, split: _question_stream(generate, seed, split), **options)
