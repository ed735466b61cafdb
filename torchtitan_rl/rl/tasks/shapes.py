"""The ``shapes`` RL task: questions about images of simple shapes, answered in one word.

Problems are the user turns of ``data.shapes`` rows of ``RL_QUESTION_MIX`` (the colour or the
kind of one large shape, or how many shapes there are), with their images as PNG bytes: the
SFT format of those rows minus the assistant turn, whose content is the reference answer.
Candidate i of a split is drawn from ``(seed, split, i)`` alone, so every process builds the
same pools, and the train and eval splits draw different images.
"""

import itertools
import random
from collections.abc import Iterator

from torchtitan_rl.data.shapes import draw_rl_row
from torchtitan_rl.rl.tasks.builtin import Candidate


def shapes_stream(seed: int, split: str) -> Iterator[Candidate]:
    """The ``split`` candidates of ``seed``: ``(user turn with images and question, answer)``."""
    for index in itertools.count():
        # String seeds hash with SHA-512: the same draws in every process, whatever PYTHONHASHSEED is.
        *prompt, answer = draw_rl_row(random.Random(f"shapes-rl/{split}/{seed}/{index}"))["messages"]
        yield tuple(prompt), answer["content"]
