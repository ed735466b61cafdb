"""Reward functions and task factories a user would write, loaded by import path in
test_rl_plugins.py (``sort_digits`` is docs/rl.md's worked example), and broken ones whose
errors must name the function and the problem."""

import os
from types import SimpleNamespace

from torchtitan_rl.rl.tasks import Problem


def accepted_answers(problem, completion, stopped):
    """A dataset row's own column ``accepted`` lists the answers that count."""
    return 1.0 if completion.strip() in problem.extra["accepted"] else 0.0


def length_and_stop(problem, completion, stopped):
    return {"short": float(len(completion) <= 3), "stopped": stopped}


def byte_sum_parity(problem, completion, stopped):
    """A reward that differs between a random policy's completions."""
    return float(sum(completion.encode()) % 2)


def raises(problem, completion, stopped):
    return 1 / 0


def raises_value_error(problem, completion, stopped):
    raise ValueError(f"no score for {completion!r}")


def raises_on_one_rank(problem, completion, stopped):
    """A KeyError on the launch's rank ``FAILING_RANK`` (test_train.py), 0 on the others."""
    rank = os.environ.get("RANK")
    scores = {"other ranks": 0.0}
    return scores[f"rank {rank}" if rank == os.environ["FAILING_RANK"] else "other ranks"]


def returns_nan(problem, completion, stopped):
    return float("nan")


def returns_text(problem, completion, stopped):
    return "1.0"


def returns_empty(problem, completion, stopped):
    return {}


def returns_mean(problem, completion, stopped):
    return {"mean": 1.0}


def returns_bad_name(problem, completion, stopped):
    return {"exact match": 1.0}


def returns_half_correct(problem, completion, stopped):
    return {"correct": 0.5}


def names_depend_on_completion(problem, completion, stopped):
    return {"a": 1.0} if completion == "a" else {"b": 1.0}


def takes_two(problem, completion):
    return 1.0


not_callable = 3


def two_problems(seed):
    rows = [{"prompt": f"{seed} + {n}?", "answer": str(seed + n), "level": n} for n in range(2)]
    return SimpleNamespace(train_problems=rows[:1], eval_problems=rows[1:], reward=accepted_answers)


def factory_with_unknown_argument(seed, flavour):
    return two_problems(seed)


def factory_raises():
    raise RuntimeError("no data today")


def factory_without_reward():
    train, held_out = ({"prompt": "q", "answer": "a"},), ({"prompt": "r", "answer": "b"},)
    return SimpleNamespace(train_problems=train, eval_problems=held_out)


def factory_eval_repeats_train():
    problem = Problem(({"role": "user", "content": "q"},), "a", "mine")
    return SimpleNamespace(train_problems=[problem], eval_problems=[problem], reward=accepted_answers)


def factory_bad_row():
    return SimpleNamespace(train_problems=[{"answer": "a"}], eval_problems=[], reward=accepted_answers)


def factory_of_a_string():
    return SimpleNamespace(train_problems="q", eval_problems=[], reward=accepted_answers)
