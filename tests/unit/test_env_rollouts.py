"""Multi-turn rollouts in the GRPO data path: episodes of a real (tiny) generator in a scripted
environment become samples whose loss covers exactly the sampled tokens, whose behaviour
log-probs sit on those tokens and whose advantage is the group's; the episode metrics against
counts by hand; and a broken environment stops the run with its name and the problem."""

import dataclasses
import traceback

import pytest
import torch

from test_generator import ARGS, generator_for, noisy_model
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.rl.env_rollouts import EpisodeRunner
from torchtitan_rl.rl.envs import EnvStep
from torchtitan_rl.rl.generator import SamplingParams
from torchtitan_rl.rl.plugins import UserCodeError
from torchtitan_rl.rl.rollouts import rollout_metrics, rollout_sums, score_groups, to_samples
from torchtitan_rl.rl.tasks import Reward
from torchtitan_rl.rl.tasks.task import Problem

TOKENIZER = build_tokenizer("")
STOPS = tuple(range(0, TOKENIZER.vocab_size, 3))  # a turn stops after a few tokens
PROMPTS = [[20, 21, 22], [30, 31, 32, 33, 34]]
MAX_LEN = 96


class Counter:
    """Answers every turn with a tool message until the third turn; 0.25 per call, and the
    episode is correct when its third turn has an even number of bytes."""

    def __init__(self, problem):
        self.problem, self.turns = problem, 0

    def reset(self):
        return list(self.problem.messages)

    def step(self, completion):
        self.turns += 1
        if self.turns == 3:
            return EnvStep(None, 1.0, True, len(completion.encode("utf-8", "surrogateescape")) % 2 == 0)
        return EnvStep([{"role": "tool", "content": "x" * self.turns}], 0.25, False)


def problems() -> dict[int, Problem]:
    return {i: Problem(({"role": "user", "content": "q"},), "a", f"test #{i}") for i in range(len(PROMPTS))}


def run(env_class, max_turns=4, num_samples=4):
    # Observations use every token id of the tokenizer, and take ~20 tokens each.
    args = dataclasses.replace(ARGS, vocab_size=TOKENIZER.vocab_size, max_seq_len=MAX_LEN)
    generator = generator_for(noisy_model(args, std=0.6), args)
    runner = EpisodeRunner(generator, env_class, "test_env", problems(), TOKENIZER, max_turns, MAX_LEN)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=STOPS)
    return runner.generate(PROMPTS, [0, 1], num_samples, params, seed=3, step=1)


def test_episodes_become_samples_with_loss_on_sampled_tokens_only():
    rollouts = run(Counter)
    assert {r.end_reason for r in rollouts} >= {"done"} and max(r.num_turns for r in rollouts) == 3  # premises
    rewards = [Reward(r.reward, r.correct, {}) for r in rollouts]
    groups = score_groups(rollouts, rewards, 4, "grpo", 1e-6)
    samples = to_samples(groups, MAX_LEN)
    for group in groups:
        for rollout, advantage, reward in zip(group.rollouts, group.advantages, group.rewards):
            sample = samples.pop(0)
            n = len(rollout.prompt_tokens)
            tokens = rollout.prompt_tokens + rollout.completion_tokens
            assert sample.input_ids.tolist() == tokens[:-1] and sample.labels.tolist() == tokens[1:]
            # Label j is token j + 1: the loss covers exactly the tokens the policy sampled.
            expected = [False] * (n - 1) + rollout.loss_mask
            assert sample.loss_mask.tolist() == expected
            assert sample.advantages.tolist() == pytest.approx([advantage * m for m in expected])
            logprobs = sample.sampler_logprobs.tolist()
            assert all((lp < 0) == m for lp, m in zip(logprobs, expected))
            # Reward: 0.25 per tool call, 1 for the last turn when the episode got there.
            calls = rollout.num_turns - 1
            assert reward.total == pytest.approx(0.25 * calls + (1.0 if rollout.end_reason == "done" else 0.0))


def test_episode_metrics_are_the_counts_by_hand():
    rollouts = run(Counter)
    groups = score_groups(rollouts, [Reward(r.reward, r.correct, {}) for r in rollouts], 4, "grpo", 1e-6)
    values = rollout_metrics(*rollout_sums(groups, 0), None)
    n = len(rollouts)
    observation = [sum(not m for m in r.loss_mask) for r in rollouts]
    assert values["rl/turns_mean"] == pytest.approx(sum(r.num_turns for r in rollouts) / n)
    assert values["rl/observations_mean"] == pytest.approx(sum(r.num_turns - 1 for r in rollouts) / n)
    assert values["rl/observation_tokens_mean"] == pytest.approx(sum(observation) / n)
    lengths = [len(r.prompt_tokens) + len(r.completion_tokens) for r in rollouts]
    assert values["rl/episode_tokens_mean"] == pytest.approx(sum(lengths) / n)
    assert values["rl/episodes_truncated"] == pytest.approx(sum(r.end_reason != "done" for r in rollouts) / n)
    assert values["rl/pass@1"] == pytest.approx(sum(r.correct for r in rollouts) / n)


class Raises(Counter):
    def step(self, completion):
        raise KeyError("boom")


class RejectsItsProblem(Counter):
    def __init__(self, problem):
        raise ValueError(f"cannot read {problem.source}")


class WrongType(Counter):
    def step(self, completion):
        return (None, 1.0, True)


class NoObservation(Counter):
    def step(self, completion):
        return EnvStep(None, 0.0, False)


class AssistantObservation(Counter):
    def step(self, completion):
        return EnvStep([{"role": "assistant", "content": "me"}], 0.0, False)


@pytest.mark.parametrize(
    "env_class, error, message",
    [
        # What the environment's code raises, a ValueError included, keeps its traceback.
        (Raises, UserCodeError, "step() raised KeyError: 'boom'"),
        (RejectsItsProblem, UserCodeError, "creating the environment raised ValueError: cannot read test #"),
        (WrongType, ValueError, "step() returned tuple, not an EnvStep"),
        (NoObservation, ValueError, "step() continued the episode without an observation"),
        (AssistantObservation, ValueError, "an observation cannot contain an assistant turn"),
    ],
)
def test_a_broken_environment_is_named_with_the_problem(env_class, error, message):
    with pytest.raises(error, match=r"rl.env = 'test_env' on test #\d: ") as info:
        run(env_class)
    assert message in str(info.value)
    if error is UserCodeError:
        # Chained: the user's exception, with its traceback down to the environment's frame.
        frame = traceback.extract_tb(info.value.__cause__.__traceback__)[-1]
        assert (frame.filename, frame.name) == (__file__, "step" if env_class is Raises else "__init__")


def test_observations_that_do_not_fit_end_the_episode_as_truncated():
    class Long(Counter):
        def step(self, completion):
            return EnvStep([{"role": "tool", "content": "y" * MAX_LEN}], 0.0, False)

    rollouts = run(Long)
    stopped = [r for r in rollouts if r.num_turns == 1 and r.stop_reason == "length"]
    assert stopped and all(r.end_reason == "length" for r in stopped)
    assert all(all(r.loss_mask) for r in rollouts)  # no observation was appended
    assert torch.tensor([r.num_observation_tokens for r in rollouts]).sum() == 0
