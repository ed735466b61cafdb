"""Question generators of the built-in synthetic tasks: each draws one ``(question, answer)``
pair from a ``random.Random``.

The same generators make the SFT rows of ``data.tasks`` (and the text questions of
``data.shapes``) and the RL problems of ``torchtitan_rl.rl.tasks``, so both recipes train on
the same distribution.
"""

import random
import string
from collections.abc import Callable

QuestionGenerator = Callable[[random.Random], tuple[str, str]]
"""Draws one ``(question, answer)`` pair from ``rng``."""


def arithmetic_question(rng: random.Random) -> tuple[str, str]:
    """``What is a op b?`` → the integer result, for op in +, -, * on small non-negative numbers."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        result = a * b
    else:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if op == "-":
            # Keep answers non-negative: one fewer output pattern for a tiny model to learn.
            a, b = max(a, b), min(a, b)
        result = a + b if op == "+" else a - b
    return f"What is {a} {op} {b}?", str(result)


def reverse_question(rng: random.Random) -> tuple[str, str]:
    """``Reverse the string: abc`` → ``cba``, for random lowercase strings of 3 to 8 letters."""
    text = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8)))
    return f"Reverse the string: {text}", text[::-1]


QUESTION_GENERATORS: dict[str, QuestionGenerator] = {
    "arithmetic": arithmetic_question,
    "reverse": reverse_question,
}


# ------------------------------------------------------------------ problems of the RL environments
# (torchtitan_rl/rl/envs): RL tasks only, not SFT datasets, since their answers are reached over
# several turns.


def calculator_question(rng: random.Random) -> tuple[str, str]:
    """``What is a * b + c? Use the calculator.`` with two-digit a, b and three-digit c: a
    four-digit answer no tiny model computes token by token, one call away with the tool."""
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(100, 999)
    return f"What is {a} * {b} + {c}? Use the calculator.", str(a * b + c)


GUESS_LARGEST = 16


def guess_number_question(rng: random.Random) -> tuple[str, str]:
    """A secret number in 1..16 behind a game number (drawn apart from the secret, so it tells
    nothing; it only makes the prompts of a pool distinct)."""
    game, secret = rng.randint(0, 9999), rng.randint(1, GUESS_LARGEST)
    question = f"Game {game}: guess my number from 1 to {GUESS_LARGEST}."
    return question, str(secret)


ENV_QUESTION_GENERATORS: dict[str, QuestionGenerator] = {
    "calculator": calculator_question,
    "guess_number": guess_number_question,
}
