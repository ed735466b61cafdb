"""Rollouts of multi-turn environments: one environment per episode, its answers tokenized once
and appended to the episode's token stream (``rl/episodes.py``).

``EpisodeRunner`` has the generator's ``generate`` signature, so the step sampler and evaluation
use it where a single-turn task uses the generator; its rollouts carry which of their tokens
were sampled (the loss tokens), the episode's summed reward and whether it was solved.
"""

from dataclasses import dataclass, field

from torchtitan_rl.data.chat import tokenize_observation
from torchtitan_rl.data.tokenizer import Tokenizer
from torchtitan_rl.rl.envs import EnvStep
from torchtitan_rl.rl.episodes import generate_episodes
from torchtitan_rl.rl.generator import Rollout, SamplingParams, TorchGenerator
from torchtitan_rl.rl.plugins import calling_user_code
from torchtitan_rl.rl.tasks.task import Problem


@dataclass
class EpisodeRollout(Rollout):
    """A multi-turn rollout: ``completion_tokens`` are every token after the prompt (sampled
    turns and observations), ``logprobs`` is 0 at observation tokens."""

    loss_mask: list[bool] = field(default_factory=list)  # per completion token: sampled by the policy
    num_turns: int = 1
    end_reason: str = "done"  # "done", "max_turns" or "length" (rl/episodes.py)
    num_observation_tokens: int = 0
    # Per observation (in order): the roles of the environment's messages, e.g. "tool".
    observation_roles: list[str] = field(default_factory=list)
    reward: float = 0.0  # the sum of the environment's step rewards
    correct: bool = False  # the last step's verdict


def decode_completion(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The text of sampled ``tokens``.

    The model's vocabulary may be larger than the tokenizer's (padding rows it can still
    sample): such an id reads as U+FFFD, so an answer containing one is wrong, never
    silently shortened into a right one.
    """
    pieces, run = [], []
    for token in tokens:
        if token < tokenizer.vocab_size:
            run.append(token)
            continue
        pieces += [tokenizer.decode(run), "\ufffd"]
        run = []
    return "".join(pieces) + tokenizer.decode(run)


class EpisodeRunner:
    """Runs ``env_class(problem)`` episodes of the problems ``problems[prompt_index]``."""

    def __init__(
        self,
        generator: TorchGenerator,
        env_class: type,
        env_name: str,
        problems: dict[int, Problem],
        tokenizer: Tokenizer,
        max_turns: int,
        max_len: int,
    ):
        self.generator, self.env_class, self.env_name = generator, env_class, env_name
        self.problems, self.tokenizer = problems, tokenizer
        self.max_turns, self.max_len = max_turns, max_len

    @classmethod
    def for_run(cls, job_config, generator: TorchGenerator, env_class: type, problems: dict[int, Problem], tokenizer):
        """A runner with the run's ``rl.env``, ``rl.max_turns`` and length budget (``training.seq_len``
        + 1 tokens: a sample's inputs and one more)."""
        rl = job_config.rl
        return cls(generator, env_class, rl.env, problems, tokenizer, rl.max_turns, job_config.training.seq_len + 1)

    def generate(
        self,
        prompts: list[list[int]],
        prompt_indices: list[int],
        num_samples: int,
        params: SamplingParams,
        seed: int,
        step: int,
        images=None,
    ) -> list[EpisodeRollout]:
        if images is not None and any(images):
            raise ValueError(f"rl.env = {self.env_name!r}: multi-turn episodes take text prompts, not images")
        envs = {(p, s): self._make(p) for p in prompt_indices for s in range(num_samples)}
        totals = {key: [0.0, False] for key in envs}
        roles: dict[tuple[int, int], list[str]] = {key: [] for key in envs}

        def respond(p: int, s: int, turn: list[int]) -> list[int] | None:
            result = self._step(envs[(p, s)], p, decode_completion(self.tokenizer, turn[:-1]))
            totals[(p, s)][0] += result.reward
            totals[(p, s)][1] = result.correct
            if result.done:
                return None
            try:
                tokens = tokenize_observation(result.observation, self.tokenizer)
            except ValueError as err:
                raise ValueError(f"{self._where(p)}: {err}") from None
            roles[(p, s)].append("+".join(message["role"] for message in result.observation))
            return tokens

        episodes = generate_episodes(
            self.generator,
            prompts,
            prompt_indices,
            num_samples,
            params,
            seed,
            step,
            respond,
            self.max_turns,
            self.max_len,
        )
        rollouts = []
        for episode, prompt in zip(episodes, (p for p in prompts for _ in range(num_samples))):
            n = len(prompt)
            mask = episode.sampled[n:]
            reward, correct = totals[(episode.prompt_index, episode.sample_index)]
            rollouts.append(
                EpisodeRollout(
                    episode.prompt_index,
                    episode.sample_index,
                    episode.tokens[:n],
                    episode.tokens[n:],
                    episode.logprobs[n:],
                    "length" if episode.end_reason == "length" else "stop",
                    episode.version,
                    routing=episode.routing,
                    loss_mask=mask,
                    num_turns=episode.num_turns,
                    end_reason=episode.end_reason,
                    num_observation_tokens=len(mask) - sum(mask),
                    observation_roles=roles[(episode.prompt_index, episode.sample_index)],
                    reward=reward,
                    correct=correct,
                )
            )
        return rollouts

    def _where(self, prompt_index: int) -> str:
        return f"rl.env = {self.env_name!r} on {self.problems[prompt_index].source}"

    def _make(self, prompt_index: int):
        with calling_user_code(f"{self._where(prompt_index)}: creating the environment"):
            return self.env_class(self.problems[prompt_index])

    def _step(self, env, prompt_index: int, completion: str) -> EnvStep:
        with calling_user_code(f"{self._where(prompt_index)}: step()"):
            result = env.step(completion)
        if not isinstance(result, EnvStep):
            raise ValueError(f"{self._where(prompt_index)}: step() returned {type(result).__name__}, not an EnvStep")
        if not result.done and not result.observation:
            raise ValueError(f"{self._where(prompt_index)}: step() continued the episode without an observation")
        return result
