"""What an RL recipe needs from a verifiable task: prompts with reference answers, and a reward."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from torchtitan_rl.rl.tasks.rewards import Reward, RewardSpec


@dataclass(frozen=True)
class Problem:
    messages: tuple[dict, ...]
    """The prompt as chat messages (system and/or user turns), without the assistant turn."""
    answer: str
    """The reference answer."""
    source: str
    """Where it came from, for error messages: ``arithmetic train #12``, ``data.jsonl:34``."""

    def prompt_key(self) -> tuple[tuple[str, str], ...]:
        """The prompt as a hashable value: problems with equal keys have equal prompt tokens."""
        return tuple((m["role"], m["content"]) for m in self.messages)


class Task(Protocol):
    name: str
    train_problems: Sequence[Problem]
    """The prompt pool the RL stream samples from."""
    eval_problems: Sequence[Problem]
    """Held out: no eval prompt is also a train prompt."""

    def reward(self, problem: Problem, completion: str, stopped: bool) -> Reward:
        """``completion`` is decoded without its stop token; ``stopped`` is False when cut at max length."""
        ...

    def sft_rows(self) -> list[dict]:
        """The train problems answered, as chat rows for an SFT warm start."""
        ...


@dataclass(frozen=True)
class VerifiableTask:
    """A task whose reward only compares the completion with the problem's reference answer."""

    name: str
    train_problems: tuple[Problem, ...]
    eval_problems: tuple[Problem, ...]
    reward_spec: RewardSpec

    def reward(self, problem: Problem, completion: str, stopped: bool) -> Reward:
        return self.reward_spec.score(completion, problem.answer, stopped)

    def sft_rows(self) -> list[dict]:
        # Copies: a caller editing a row must not edit the problems the RL stream samples.
        return [
            {"messages": [dict(m) for m in problem.messages] + [{"role": "assistant", "content": problem.answer}]}
            for problem in self.train_problems
        ]
