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
        return self.reward_spec.score(completion, problem.answer, stopped)


def answered_rows(problems: Sequence[Problem]) -> list[dict]:
    """``problems`` with their reference answers as the assistant turn: chat rows for SFT."""
    # Copies: a caller editing a row must not edit the problems the RL stream samples.
    return [
        {"messages": [dict(m) for m in problem.messages] + [{"role": "assistant", "content": problem.answer}]}
        for problem in problems
    ]
