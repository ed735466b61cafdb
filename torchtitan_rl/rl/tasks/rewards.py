"""Score a completion against a task's reference answer.

With ``c = completion.strip()`` and ``a = answer.strip()``:

* ``correct``: ``c == a`` (``answer_match="exact"``); or, with ``answer_match="numeric"``, both
  are decimal numbers (``-3``, ``2.50``, ``1e3``; no ``nan``/``inf``/thousands separators) whose
  values x, y satisfy ``|x - y| <= 1e-6 * max(|x|, |y|)``. A completion that is not a number is wrong.
* ``partial`` ∈ [0, 1]: 1 when correct, else ``#{i : c[i] == a[i]} / max(len(c), len(a))``
  (positions compared up to the shorter length). It is below 1 for every wrong answer.
* ``format``: 1 when the sampler stopped on a stop token, 0 when it cut the completion at max length.
* ``total = (1 if correct else partial_credit * partial) + format_reward * format``.

``Reward.components`` holds the unweighted ``correct``, ``partial`` and ``format`` values, so
logs show what the model got right whatever the weights; only ``total`` reaches the advantages.
"""

import math
import re
from dataclasses import dataclass

ANSWER_MATCHES = ("exact", "numeric")
NUMERIC_RELATIVE_TOLERANCE = 1e-6
OVERLONG_COMPONENT = "overlong"
"""The component of the overlong length penalty (``rl/length_shaping.py``)."""
_DECIMAL_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


@dataclass(frozen=True)
class Reward:
    total: float
    """What the advantage estimator sees."""
    correct: bool
    """Whether the answer matched; what pass@1 / pass@k count."""
    components: dict[str, float]
    """Unweighted ``correct``, ``partial`` and ``format`` in [0, 1] (and, with length shaping,
    the non-positive ``overlong`` penalty, ``rl/length_shaping.py``); logged as ``rl/reward_<name>``."""


def parse_number(text: str) -> float | None:
    """The value of ``text`` when it is one finite decimal number (surrounding spaces allowed), else None."""
    text = text.strip()
    if _DECIMAL_NUMBER.fullmatch(text) is None:
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def partial_match(completion: str, answer: str) -> float:
    """The fraction of positions where the stripped strings agree, over the longer one's length."""
    completion, answer = completion.strip(), answer.strip()
    matches = sum(c == a for c, a in zip(completion, answer))
    return matches / max(len(completion), len(answer), 1)


@dataclass(frozen=True)
class RewardSpec:
    """How a task turns (answer, completion, stopped) into a ``Reward``; validated on construction."""

    partial_credit: float = 0.0
    format_reward: float = 0.0
    answer_match: str = "exact"

    def __post_init__(self):
        if self.answer_match not in ANSWER_MATCHES:
            raise ValueError(f"answer_match={self.answer_match!r} is not one of {ANSWER_MATCHES}")
        # Above 1, a wrong answer could outscore a correct one.
        if not 0.0 <= self.partial_credit <= 1.0:
            raise ValueError(f"partial_credit={self.partial_credit} must be in [0, 1]")
        if not (math.isfinite(self.format_reward) and self.format_reward >= 0.0):
            raise ValueError(f"format_reward={self.format_reward} must be a finite number >= 0")

    def is_correct(self, completion: str, answer: str) -> bool:
        if self.answer_match == "exact":
            return completion.strip() == answer.strip()
        value, expected = parse_number(completion), parse_number(answer)
        if value is None or expected is None:
            return False
        return math.isclose(value, expected, rel_tol=NUMERIC_RELATIVE_TOLERANCE, abs_tol=0.0)

    def score(self, completion: str, answer: str, stopped: bool) -> Reward:
        correct = self.is_correct(completion, answer)
        partial = 1.0 if correct else partial_match(completion, answer)
        format_score = 1.0 if stopped else 0.0
        total = (1.0 if correct else self.partial_credit * partial) + self.format_reward * format_score
        components = {"correct": float(correct), "partial": partial, "format": format_score}
        return Reward(total=total, correct=correct, components=components)
