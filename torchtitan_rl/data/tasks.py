"""Built-in synthetic chat tasks: no download, deterministic in the seed, learnable by tiny models.

Answers are short and the phrasing never varies, so a few-million-parameter model trained for
a few hundred steps visibly lowers its loss; that makes these tasks the smoke tests of recipes.
Each text task is one question generator of ``data.questions``, shared by the SFT rows here and
the RL problems of ``torchtitan_rl.rl.tasks``, so both recipes train on the same distribution.
"""

import random
from collections.abc import Callable, Sequence

from torchtitan_rl.data.questions import (
    QuestionGenerator,
    arithmetic_question,
    reverse_question,
)


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


def arithmetic_preferences(num_samples: int, seed: int) -> list[dict]:
    """``num_samples`` preference rows of ``arithmetic_question`` from ``seed``: the question as a
    conversational prompt, the right answer chosen, a wrong one rejected (the right one off by
    1 to 10, never negative: a near miss a model can confuse it with)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        question, answer = arithmetic_question(rng)
        right = int(answer)
        wrong = right + rng.choice([-1, 1]) * rng.randint(1, 10)
        if wrong < 0:
            wrong = right + rng.randint(1, 10)
        rows.append({"prompt": [{"role": "user", "content": question}], "chosen": answer, "rejected": str(wrong)})
    return rows


def shapes(num_samples: int, seed: int):
    """``num_samples`` vision-language rows of ``data.shapes`` (images of shapes + questions) from ``seed``."""
    # Imported on use: text runs never load pillow.
    from torchtitan_rl.data.shapes import shapes as shapes_rows

    return shapes_rows(num_samples, seed)


# SFT tasks (rows); the text ones are also RL tasks through data.questions.QUESTION_GENERATORS.
# arithmetic_preferences: chosen / rejected pairs for job.recipe = "dpo".
BUILTIN_TASKS: dict[str, Callable[[int, int], Sequence[dict]]] = {
    "arithmetic": arithmetic,
    "reverse": reverse,
    "shapes": shapes,
    "arithmetic_preferences": arithmetic_preferences,
}
