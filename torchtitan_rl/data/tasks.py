"""Built-in synthetic chat tasks: no download, deterministic in the seed, learnable by tiny models.

Answers are short and the phrasing never varies, so a few-million-parameter model trained for
a few hundred steps visibly lowers its loss; that makes these tasks the smoke tests of recipes.
Each task is one question generator, shared by the SFT rows here and the RL problems of
``torchtitan_rl.rl.tasks``, so both recipes train on the same distribution.
"""

import random
import string
from collections.abc import Callable, Sequence

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


def _chat_rows(generate: QuestionGenerator, num_samples: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        question, answer = generate(rng)
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return rows


def arithmetic(num_samples: int, seed: int) -> list[dict]:
    """``num_samples`` chat rows of ``arithmetic_question`` from ``seed``."""
    return _chat_rows(arithmetic_question, num_samples, seed)


def reverse(num_samples: int, seed: int) -> list[dict]:
    """``num_samples`` chat rows of ``reverse_question`` from ``seed``."""
    return _chat_rows(reverse_question, num_samples, seed)


def shapes(num_samples: int, seed: int):
    """``num_samples`` vision-language rows of ``data.shapes`` (images of shapes + questions) from ``seed``."""
    # Imported on use: text runs never load pillow. (data.shapes uses arithmetic_question above.)
    from torchtitan_rl.data.shapes import shapes as shapes_rows

    return shapes_rows(num_samples, seed)


# SFT tasks (rows); the text ones are also RL tasks through QUESTION_GENERATORS.
BUILTIN_TASKS: dict[str, Callable[[int, int], Sequence[dict]]] = {
    "arithmetic": arithmetic,
    "reverse": reverse,
    "shapes": shapes,
}
IMAGE_TASKS = ("shapes",)
"""Built-in tasks whose rows carry images: they need a vision-language model."""
