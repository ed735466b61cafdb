"""Built-in ``shapes`` task: questions about simple shapes drawn in memory, answerable from pixels alone.

Each row is a chat in the ``messages`` format whose user turn holds 0 to 2 images (PNG bytes)
and a fixed question; the assistant answers in one or two words. Images have random sizes
(long side 48..192 pixels) and aspect ratios from 1:4 to 4:1, so image counts, patches and
token counts vary from sample to sample. The mix (``QUESTION_MIX``):

- ``colour`` (40 %): one large shape (70..95 % of the short side) → its colour name;
- ``count`` (20 %): 1..3 shapes in separate cells of a grid → ``1``, ``2`` or ``3``;
- ``more`` (15 %): two images of 1..3 shapes with different counts → ``image 1`` / ``image 2``;
- ``left_right`` (10 %): one shape in the left or right half of a wide image → ``left`` /
  ``right``. A tiny Pixtral stayed at chance on it in our training runs (it has no absolute
  position embedding), so its share is small;
- ``text`` (15 %): the text-only ``arithmetic`` question.

RL problems (the ``shapes`` task of ``torchtitan_rl.rl.tasks``) follow ``RL_QUESTION_MIX``:
questions with one-word answers a tiny model learns from the image, including ``shape`` (one
large shape, as in ``colour`` → ``circle`` / ``square`` / ``triangle``), which SFT rows never ask.

Shapes are drawn without anti-aliasing on a white background, so every pixel has exactly the
background colour or one of ``COLOURS``: answers can be recomputed from the pixels. Row i
depends only on ``(seed, i)``: rows are drawn when indexed, never held in memory.
"""

import io
import math
import random
from collections.abc import Sequence

from PIL import Image, ImageDraw

from torchtitan_rl.data.questions import arithmetic_question

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (150, 60, 190),
    "cyan": (30, 190, 200),
}
"""Colour names (the ``colour`` answers; chance is ``1 / len(COLOURS)``) and their exact RGB."""
BACKGROUND = (255, 255, 255)
SHAPE_KINDS = ("circle", "square", "triangle")
QUESTIONS = {
    "colour": "What colour is the shape?",
    "count": "How many shapes are there?",
    "more": "Which image has more shapes?",
    "left_right": "Is the shape on the left or on the right?",
    "shape": "What shape is it?",
}
QUESTION_MIX = (("colour", 0.40), ("count", 0.20), ("more", 0.15), ("left_right", 0.10), ("text", 0.15))
"""The SFT rows' question shares (recipes and benchmarks rely on them: keep them as they are)."""
RL_QUESTION_MIX = (("colour", 0.4), ("shape", 0.4), ("count", 0.2))
"""The RL problems' shares: one-word answers, verifiable exactly, about images a tiny model can learn."""
LONG_SIDE = (48, 192)
MAX_ASPECT = 4.0
MIN_COLOUR_SHAPE = 0.7  # shape size / short side of a colour image (>= 0.7 was learned fast in our runs)


def _canvas_size(rng: random.Random, min_aspect: float, max_aspect: float) -> tuple[int, int]:
    """``(width, height)`` with width/height log-uniform in [min_aspect, max_aspect]."""
    aspect = math.exp(rng.uniform(math.log(min_aspect), math.log(max_aspect)))
    long_side = rng.randint(*LONG_SIDE)
    if aspect >= 1:
        return long_side, max(1, round(long_side / aspect))
    return max(1, round(long_side * aspect)), long_side


def _draw_shape(draw: ImageDraw.ImageDraw, kind: str, x: int, y: int, size: int, colour: str) -> None:
    """A ``kind`` shape filling the ``size``-pixel square at (x, y)."""
    box = (x, y, x + size - 1, y + size - 1)
    fill = COLOURS[colour]
    if kind == "circle":
        draw.ellipse(box, fill=fill)
    elif kind == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x, y + size - 1), (x + size - 1, y + size - 1), (x + (size - 1) / 2, y)], fill=fill)


def _png(width: int, height: int, shapes: list[tuple[str, int, int, int, str]]) -> bytes:
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        _draw_shape(draw, *shape)
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)  # lossless; level 1 is the fast one
    return out.getvalue()


def _random_shape(rng: random.Random) -> tuple[str, str]:
    return rng.choice(SHAPE_KINDS), rng.choice(sorted(COLOURS))


def large_shape_image(rng: random.Random) -> tuple[bytes, str, str]:
    """One shape of 70..95 % of the short side, anywhere → (PNG, shape kind, colour name)."""
    width, height = _canvas_size(rng, 1 / MAX_ASPECT, MAX_ASPECT)
    short = min(width, height)
    size = max(1, min(short, math.ceil(rng.uniform(MIN_COLOUR_SHAPE, 0.95) * short)))
    kind, colour = _random_shape(rng)
    x, y = rng.randint(0, width - size), rng.randint(0, height - size)
    return _png(width, height, [(kind, x, y, size, colour)]), kind, colour


def colour_image(rng: random.Random) -> tuple[bytes, str]:
    """``large_shape_image`` → (PNG, colour name)."""
    png, _, colour = large_shape_image(rng)
    return png, colour


def left_right_image(rng: random.Random) -> tuple[bytes, str]:
    """One shape entirely in the left or right half of a wide (1.5:1 to 4:1) image → (PNG, side)."""
    width, height = _canvas_size(rng, 1.5, MAX_ASPECT)
    size = max(1, min(width // 2 - 1, round(rng.uniform(0.5, 0.7) * height)))
    side = rng.choice(("left", "right"))
    # Pixels x..x+size-1 lie below width/2 (left) or at or above it (right).
    x = rng.randint(0, width // 2 - size) if side == "left" else rng.randint((width + 1) // 2, width - size)
    y = rng.randint(0, height - size)
    kind, colour = _random_shape(rng)
    return _png(width, height, [(kind, x, y, size, colour)]), side


def count_image(rng: random.Random, count: int) -> bytes:
    """``count`` shapes, each inside its own cell of a grid (2x2, or 1 x 3..4 along a long side)."""
    width, height = _canvas_size(rng, 1 / MAX_ASPECT, MAX_ASPECT)
    ratio = max(width, height) / min(width, height)
    along = 2 if ratio < 2 else min(4, max(3, int(ratio)))
    across = 2 if ratio < 2 else 1
    cols, rows = (along, across) if width >= height else (across, along)
    shapes = []
    for cell in rng.sample(range(rows * cols), count):
        row, col = divmod(cell, cols)
        x0, x1 = col * width // cols, (col + 1) * width // cols
        y0, y1 = row * height // rows, (row + 1) * height // rows
        # A one-pixel margin inside the cell: shapes of neighbouring cells never touch.
        room = min(x1 - x0, y1 - y0) - 2
        size = max(1, round(rng.uniform(0.6, 0.9) * room))
        x, y = rng.randint(x0 + 1, x1 - 1 - size), rng.randint(y0 + 1, y1 - 1 - size)
        kind, colour = _random_shape(rng)
        shapes.append((kind, x, y, size, colour))
    return _png(width, height, shapes)


def _image_part(png: bytes) -> dict:
    return {"type": "image", "image": png}


def _chat(content, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


def draw_row(rng: random.Random, kind: str) -> dict:
    """One row of question ``kind`` (a key of ``QUESTIONS`` or ``text``)."""
    if kind == "colour":
        png, answer = colour_image(rng)
        parts = [_image_part(png)]
    elif kind == "shape":
        png, answer, _ = large_shape_image(rng)
        parts = [_image_part(png)]
    elif kind == "left_right":
        png, answer = left_right_image(rng)
        parts = [_image_part(png)]
    elif kind == "count":
        count = rng.randint(1, 3)
        parts, answer = [_image_part(count_image(rng, count))], str(count)
    elif kind == "more":
        first, second = rng.sample((1, 2, 3), 2)
        parts = [_image_part(count_image(rng, first)), _image_part(count_image(rng, second))]
        answer = "image 1" if first > second else "image 2"
    elif kind == "text":
        question, answer = arithmetic_question(rng)
        return _chat(question, answer)
    else:
        raise ValueError(f"unknown shapes question kind {kind!r}; expected one of {[*QUESTIONS, 'text']}")
    return _chat(parts + [{"type": "text", "text": QUESTIONS[kind]}], answer)


def _kind(rng: random.Random, mix: Sequence[tuple[str, float]] = QUESTION_MIX) -> str:
    """A question kind of ``mix`` (shares summing to 1), from one draw of ``rng``."""
    draw = rng.random()
    for kind, share in mix:
        draw -= share
        if draw < 0:
            return kind
    return mix[-1][0]


def draw_rl_row(rng: random.Random) -> dict:
    """One row of a question kind drawn from ``RL_QUESTION_MIX``: what an RL problem of ``rng`` asks."""
    return draw_row(rng, _kind(rng, RL_QUESTION_MIX))


class ShapesRows(Sequence):
    """``num_samples`` rows drawn on access: row i from ``random.Random(f"{name}/{seed}/{i}")``.

    Drawing an image costs well under a millisecond, and holding thousands of them would not
    be free; each rank draws only the rows it visits. Equal when their rows are equal.
    """

    def __init__(self, num_samples: int, seed: int, kind: str | None = None):
        self.num_samples, self.seed, self.kind = num_samples, seed, kind

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        index %= len(self)
        # String seeds hash with SHA-512: the same rows in every process, whatever PYTHONHASHSEED is.
        rng = random.Random(f"shapes/{self.kind or 'mix'}/{self.seed}/{index}")
        return draw_row(rng, self.kind or _kind(rng))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or len(self) != len(other):
            return NotImplemented if not isinstance(other, Sequence) else False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None


def shapes(num_samples: int, seed: int) -> ShapesRows:
    """``num_samples`` rows of the question mix from ``seed``."""
    return ShapesRows(num_samples, seed)


def colour_rows(num_samples: int, seed: int) -> ShapesRows:
    """``num_samples`` colour-question rows (the answer is ``row["messages"][-1]["content"]``, one
    of ``COLOURS``): the subset a benchmark measures accuracy on, with chance ``1 / len(COLOURS)``."""
    return ShapesRows(num_samples, seed, kind="colour")
