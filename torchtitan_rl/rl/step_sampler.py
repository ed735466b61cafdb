"""A step's rollouts from a task's prompts: generation, rewards, advantages and dynamic sampling.

The same code runs wherever rollouts are made. Colocated, every training rank samples its own
prompt slots (its CP / TP peers split the work), dynamic sampling shares which groups have
signal over the ``batch`` mesh and moves each kept group to the rank that trains it, and the
rollout metrics are reduced over that mesh. With rollout ranks, those ranks sample every slot
of the step among themselves (their ``rollout`` mesh plays the peers) and send the result to
the trainers.
Either way a rollout's randomness is keyed by (seed, step, candidate index, sample) alone, so
the step's rollouts do not depend on who generates them.
"""

import contextlib
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.config import JobConfig
from torchtitan_rl.data.tokenizer import Tokenizer
from torchtitan_rl.distributed.utils import failures_shared
from torchtitan_rl.rl.dynamic_sampling import SignalExchange, round_offset, select_groups_with_signal
from torchtitan_rl.rl.env_rollouts import EpisodeRollout, EpisodeRunner, decode_completion
from torchtitan_rl.rl.generator import PromptImages, Rollout, RolloutEngine, SamplingParams
from torchtitan_rl.rl.length_shaping import shape_overlong
from torchtitan_rl.rl.reward_model_scores import (
    RewardModelScorer,
    RewardModelSettings,
    normalized,
    with_model_scores,
)
from torchtitan_rl.rl.rollouts import (
    PromptStream,
    ScoredGroup,
    exchange_among_peers,
    generate_share,
    is_truncated,
    is_zero_variance,
    rollout_metrics,
    rollout_sums,
    score_groups,
    split_among_peers,
)
from torchtitan_rl.rl.tasks import Reward, Task


@dataclass
class SampledStep:
    """What a step's sampling produced on this rank."""

    kept: list[ScoredGroup]  # the groups to train, of the slots asked for
    # rl/* of the step: the rollout metrics of every group generated (of every round, trained or
    # not) over the ``batch`` mesh, rl/dynamic_sampling/*
    values: dict[str, float] = field(default_factory=dict)
    num_generated: int = 0  # tokens this rank generated


class StepSampler:
    """Draws a step's prompts from ``stream``, generates ``rl.group_size`` completions of each,
    rewards them with ``task`` (and ``reward_model``, when given) and scores the groups.
    ``images[i]``: prompt i's images (a vision-language model; None: text prompts)."""

    def __init__(
        self,
        job_config: JobConfig,
        task: Task,
        prompts: list[list[int]],
        tokenizer: Tokenizer,
        generator: RolloutEngine,
        sampling: SamplingParams,
        stream: PromptStream,
        env_class: type | None = None,
        images: list[PromptImages] | None = None,
        reward_model: RewardModelScorer | None = None,
    ):
        self.rl, self.seed = job_config.rl, job_config.generation.seed
        self.job_config = job_config
        self.task, self.prompts, self.tokenizer = task, prompts, tokenizer
        self.generator, self.sampling, self.stream = generator, sampling, stream
        self.env_class = env_class
        self.images = images
        self.reward_model = reward_model
        rl = self.rl
        self.reward_model_settings = RewardModelSettings(
            rl.reward_model_weight, rl.reward_model_normalize, rl.reward_model_alone
        )

    def sample(
        self,
        step: int,
        slots: list[int],
        batch_mesh: DeviceMesh | None,
        peer_mesh: DeviceMesh | None,
        group: dist.ProcessGroup | None,
        times: dict[str, float],
        warn: bool = False,
    ) -> SampledStep:
        """The groups of ``slots`` to train at ``step`` (this rank's share of the ``batch``
        mesh), the step's rollout metrics and the tokens this rank generated. ``peer_mesh``
        splits the generation of ``slots`` and exchanges the rollouts; with dynamic sampling
        the ranks of ``batch_mesh`` share which groups have signal after every round, and each
        kept group goes to the rank that trains it (``SignalExchange``). ``group``:
        every rank that samples the step, which all stop when the generation or the reward
        fails on one of them (``failures_shared``; None: this rank alone)."""
        rl = self.rl
        out = SampledStep([])
        generated: list[ScoredGroup] = []

        def draw_round(round_index: int) -> list[ScoredGroup]:
            groups, num_tokens = self._sample_round(step, round_index, slots, batch_mesh, peer_mesh, group, times)
            generated.extend(groups)
            out.num_generated += num_tokens
            return groups

        if rl.dynamic_sampling:
            exchange = SignalExchange(slots, batch_mesh)

            def draw_whole_round(round_index: int) -> list[int]:
                groups = draw_round(round_index)
                with timed(times, "signal_exchange"):
                    return exchange.round_with_signal(groups)

            selection = select_groups_with_signal(draw_whole_round, rl.prompts_per_step, rl.max_sampling_rounds, warn)
            with timed(times, "signal_exchange"):
                out.kept = exchange.trained_groups(selection)
            out.values["rl/dynamic_sampling/rounds"] = float(selection.num_rounds)
            out.values["rl/dynamic_sampling/groups_with_signal"] = float(selection.num_with_signal)
        else:
            groups = draw_round(0)
            out.kept = [g for g in groups if not (rl.filter_zero_variance_groups and is_zero_variance(g))]
        out.values.update(self._rollout_metrics(generated, out.kept, batch_mesh))
        return out

    def _rollout_metrics(
        self, generated: list[ScoredGroup], kept: list[ScoredGroup], batch_mesh: DeviceMesh | None
    ) -> dict[str, float]:
        """The ``rl/*`` rollout metrics of every group generated, trained or not (collective over
        ``batch_mesh``)."""
        rl = self.rl
        filtering = rl.dynamic_sampling or rl.filter_zero_variance_groups
        num_filtered = sum(is_zero_variance(g) for g in generated) if filtering else 0
        masked = sum(is_truncated(r) for g in kept for r in g.rollouts) if rl.mask_truncated else None
        return rollout_metrics(*rollout_sums(generated, num_filtered, masked), batch_mesh)

    def _sample_round(
        self,
        step: int,
        round_index: int,
        slots: list[int],
        batch_mesh: DeviceMesh | None,
        peer_mesh: DeviceMesh | None,
        group: dist.ProcessGroup | None,
        times: dict,
    ) -> tuple[list[ScoredGroup], int]:
        """Round ``round_index`` of the step on the stream's next prompts: the scored groups of
        ``slots`` (a group's slot is its candidate index, ``round_offset`` + slot) and the
        tokens this rank generated. The reward model's scores are normalized over
        ``batch_mesh`` (see ``sample``)."""
        rl = self.rl
        problem_ids = self.stream.next_step()
        offset = round_offset(round_index, rl.prompts_per_step)
        engine = self.generator
        if self.env_class is not None:
            problems = {offset + slot: self.task.train_problems[i] for slot, i in enumerate(problem_ids)}
            engine = self.episode_runner(problems)
        self.generator.take_phase_seconds()  # drop what an evaluation spent since the last round
        # Episodes run the environment's code and the exchange waits for every peer: agree first
        # (untimed: the agreement waits for the slowest rank).
        with failures_shared(group), timed(times, "generate"):
            local = generate_share(
                engine,
                [self.prompts[i] for i in problem_ids],
                slots,
                rl.group_size,
                self.sampling,
                self.seed,
                step,
                peer_mesh,
                offset,
                None if self.images is None else [self.images[i] for i in problem_ids],
            )
        # The generator's own split of the round (multi-turn episodes decode elsewhere: none).
        for phase, seconds in self.generator.take_phase_seconds().items():
            if seconds:
                times[f"generate_{phase}"] = times.get(f"generate_{phase}", 0.0) + seconds
        with timed(times, "exchange"):
            rollouts = exchange_among_peers(local, peer_mesh)
        with failures_shared(group):
            with timed(times, "reward"):
                rewards = [self.verdict(problem_ids[r.prompt_index - offset], r) for r in rollouts]
            if self.reward_model is not None:
                # Each peer scores a share; the exchange below gives every peer all the scores.
                peer_rank, num_peers = (0, 1) if peer_mesh is None else (peer_mesh.get_local_rank(), peer_mesh.size())
                mine = split_among_peers(rollouts, peer_rank, num_peers)
                with timed(times, "reward_model"):
                    scores = self.reward_model.score([r.prompt_tokens + r.completion_tokens for r in mine])
        if self.reward_model is not None:
            with timed(times, "reward_model"):
                scores = exchange_among_peers(scores, peer_mesh)
                if self.reward_model_settings.normalize:
                    scores = normalized(scores, batch_mesh)
            rewards = with_model_scores(rewards, scores, self.reward_model_settings)
        rewards = [self.shaped(reward, r) for reward, r in zip(rewards, rollouts)]
        groups = score_groups(rollouts, rewards, rl.group_size, rl.advantage, rl.advantage_eps)
        return groups, sum(len(r.completion_tokens) for r in local)

    def episode_runner(self, problems: dict) -> EpisodeRunner:
        """Multi-turn episodes of ``problems`` (by prompt index) in ``rl.env``."""
        return EpisodeRunner.for_run(self.job_config, self.generator, self.env_class, problems, self.tokenizer)

    def verdict(self, problem_id: int, rollout: Rollout) -> Reward:
        """The verifier's reward of ``rollout`` (an episode's: its environment's)."""
        if isinstance(rollout, EpisodeRollout):
            return Reward(rollout.reward, rollout.correct, {})
        return self.task.reward(self.task.train_problems[problem_id], *completion_text(self.tokenizer, rollout))

    def shaped(self, reward: Reward, rollout: Rollout) -> Reward:
        """``reward`` with the overlong penalty of ``rollout`` when it is on (never an episode's)."""
        rl = self.rl
        if not rl.overlong_buffer or isinstance(rollout, EpisodeRollout):
            return reward
        length = len(rollout.completion_tokens)
        return shape_overlong(reward, length, self.sampling.max_new_tokens, rl.overlong_buffer, rl.overlong_penalty)


def completion_text(tokenizer: Tokenizer, rollout: Rollout) -> tuple[str, bool]:
    """The completion's text without its stop token, and whether it stopped."""
    stopped = rollout.stop_reason == "stop"
    tokens = rollout.completion_tokens[:-1] if stopped else rollout.completion_tokens
    return decode_completion(tokenizer, tokens), stopped


@contextlib.contextmanager
def timed(times: dict[str, float], phase: str):
    """Add the seconds of the ``with`` block to ``times[phase]``."""
    start = time.perf_counter()
    yield
    times[phase] = times.get(phase, 0.0) + time.perf_counter() - start
