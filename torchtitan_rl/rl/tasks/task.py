"""What an RL recipe needs from a verifiable task: prompts with reference answers, and a reward."""

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torchtitan_rl.data.chat import image_of_part
from torchtitan_rl.rl.tasks.rewards import Reward, RewardSpec

PartKey = tuple[str, str]
"""A content part as a hashable value: ``("text", text)``, ``("image bytes", sha256)`` or ``("image path", path)``."""


def _part_key(part: dict) -> PartKey:
    if part["type"] == "text":
        return ("text", part["text"])
    source = image_of_part(part)
    if isinstance(source, bytes):
        # A digest keeps keys small; equal SHA-256 digests are taken as equal bytes.
        return ("image bytes", hashlib.sha256(source).hexdigest())
    if isinstance(source, (str, os.PathLike)):
        return ("image path", os.fspath(source))
    raise ValueError(f"an image part of a problem must hold encoded bytes or a path, got {type(source).__name__}")


def _content_key(content: str | list[dict]) -> str | tuple[PartKey, ...]:
    return content if isinstance(content, str) else tuple(_part_key(part) for part in content)


def _copy_message(message: dict[str, Any]) -> dict[str, Any]:
    """A copy whose content list (if any) is a new list of new parts; the image bytes are immutable."""
    content = message["content"]
    return {**message, "content": content if isinstance(content, str) else [dict(part) for part in content]}


@dataclass(frozen=True)
class Problem:
    messages: tuple[dict, ...]
    """The prompt as chat messages (system and/or user turns), without the assistant turn; a
    content is a string or a list of text/image parts (``data.chat``), images as bytes or paths."""
    answer: str
    """The reference answer."""
    source: str
    """Where it came from, for error messages: ``arithmetic train #12``, ``data.jsonl:34``."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """The other columns of a dataset row (``rl.reward_fn`` reads them), or what a task factory put there."""

    def prompt_key(self) -> tuple[tuple[str, str | tuple[PartKey, ...]], ...]:
        """The prompt as a hashable value: problems with equal keys have equal prompt tokens and images."""
        return tuple((m["role"], _content_key(m["content"])) for m in self.messages)


class Task(Protocol):
    name: str
    train_problems: Sequence[Problem]
    """The prompt pool the RL stream samples from."""
    eval_problems: Sequence[Problem]
    """Held out: no eval prompt is also a train prompt."""
    spare_problems: Sequence[Problem]
    """Problems of the source in neither pool whose prompts are no train or eval prompt (the
    rows a jsonl task leaves out of ``rl.num_train_prompts``): what an SFT warm-up may train on."""

    def reward(self, problem: Problem, completion: str, stopped: bool) -> Reward:
        """``completion`` is decoded without its stop token; ``stopped`` is False when cut at max length."""
        ...


@dataclass(frozen=True)
class VerifiableTask:
    """A task whose reward only compares the completion with the problem's reference answer."""

    name: str
    train_problems: tuple[Problem, ...]
    eval_problems: tuple[Problem, ...]
    reward_spec: RewardSpec
    spare_problems: tuple[Problem, ...] = ()

    def reward(self, problem: Problem, completion: str, stopped: bool) -> Reward:
        if not problem.answer:
            # A row without an answer (only while a reward model rewards alone): nothing to verify.
            return Reward(total=0.0, correct=False, components={})
        return self.reward_spec.score(completion, problem.answer, stopped)


def answered_rows(problems: Sequence[Problem]) -> list[dict]:
    """``problems`` with their reference answers as the assistant turn: chat rows for SFT; a
    problem without an answer is a ValueError naming it."""
    for problem in problems:
        if not problem.answer.strip():
            raise ValueError(f"{problem.source} has no answer to train on (an SFT warm-up trains on answers)")
    # Copies: a caller editing a row must not edit the problems the RL stream samples.
    return [
        {"messages": [_copy_message(m) for m in problem.messages] + [{"role": "assistant", "content": problem.answer}]}
        for problem in problems
    ]
