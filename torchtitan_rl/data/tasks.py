"""Built-in synthetic chat tasks: no download, deterministic in the seed, learnable by tiny models.

Answers are short and the phrasing never varies, so a few-million-parameter model trained for
a few hundred steps visibly lowers its loss; that makes these tasks the smoke tests of recipes.
"""

import random
import string
from collections.abc import Callable


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def arithmetic(num_samples: int, seed: int) -> list[dict]:
    """``What is a op b?`` → the integer result, for op in +, -, * on small non-negative numbers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
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
        rows.append(_chat(f"What is {a} {op} {b}?", str(result)))
    return rows


def reverse(num_samples: int, seed: int) -> list[dict]:
    """``Reverse the string: abc`` → ``cba``, for random lowercase strings of 3 to 8 letters."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        text = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8)))
        rows.append(_chat(f"Reverse the string: {text}", text[::-1]))
    return rows


BUILTIN_TASKS: dict[str, Callable[[int, int], list[dict]]] = {
    "arithmetic": arithmetic,
    "reverse": reverse,
}
