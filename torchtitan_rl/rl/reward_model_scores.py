"""A reward model in the RL loop (``rl.reward_model``): a frozen Qwen3 with a score head that
scores each rollout's prompt and completion, added to the verifier's reward or alone.

It runs wherever the rollouts are made, on an unsharded replica like the sampler's: a
colocated trainer or a rollout rank scores the rollouts it exchanged with its peers (its CP /
TP peers, or the other rollout ranks), each peer a contiguous share, so the work is split
like the generation. Sequences are packed into batches of at most ``max_tokens`` tokens; a
sequence attends only to itself, so its score does not depend on its batch mates (nor on the
layout) beyond float rounding.

Normalization (``rl.reward_model_normalize``) standardizes the scores over a sampling round's
rollouts of every rank: the sums of the scores and their squares are reduced over the
``batch`` mesh (peers hold copies, never summed), so the statistics are those of the round,
which does not depend on the layout either.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.balance import plan_microbatches
from torchtitan_rl.distributed.utils import global_moments
from torchtitan_rl.rl.tasks import Reward

MODEL_COMPONENT = "model"
"""The reward component of the reward model's weighted score, logged as ``rl/reward_model``."""


@dataclass(frozen=True)
class RewardModelSettings:
    """How the reward model's scores enter the reward (the ``rl.reward_model*`` keys)."""

    weight: float = 1.0
    normalize: bool = False
    alone: bool = False


class RewardModelScorer:
    """``score`` gives each token sequence's score at its last token under ``model`` (a frozen
    model with a score head), in packed batches of at most ``max_tokens`` tokens."""

    def __init__(self, model: nn.Module, max_tokens: int):
        self.model = model
        self.device = next(model.parameters()).device
        self.max_tokens = max_tokens

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[float]:
        """The score of each of ``sequences`` (token ids), in order."""
        scores: list[float] = []
        for batch in plan_microbatches([len(s) for s in sequences], self.max_tokens):
            lengths = torch.tensor([len(sequences[i]) for i in batch])
            tokens = torch.tensor([t for i in batch for t in sequences[i]], device=self.device)
            positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(self.device)
            seq_ids = torch.repeat_interleave(torch.arange(len(batch)), lengths).to(self.device)
            hidden = self.model(tokens, positions, seq_ids)
            last = (torch.cumsum(lengths, 0) - 1).to(self.device)
            scores.extend(self.model.score(hidden[last])[:, 0].float().cpu().tolist())
        return scores


def normalized(scores: list[float], batch_mesh: DeviceMesh | None) -> list[float]:
    """``scores`` standardized by the mean and the (population) standard deviation of the
    scores of every rank of ``batch_mesh`` (collective; None: these alone). Equal scores all
    become 0."""
    count, mean, variance = global_moments(torch.tensor(scores, dtype=torch.float64), batch_mesh)
    if count == 0:
        return []
    std = math.sqrt(variance)
    # Scores equal up to rounding have no spread to scale: keep them equal rather than blow rounding up.
    if std <= 1e-6 * max(abs(mean), 1.0):
        return [0.0] * len(scores)
    return [(s - mean) / std for s in scores]


def with_model_scores(rewards: list[Reward], scores: list[float], settings: RewardModelSettings) -> list[Reward]:
    """Each verifier reward with the reward model's weighted score: added to its total as the
    ``model`` component, or in its place (``alone``: the verifier's verdict ``correct`` stays)."""
    out = []
    for reward, score in zip(rewards, scores, strict=True):
        if MODEL_COMPONENT in reward.components:
            raise ValueError(
                f"rl.reward_fn returned a reward component named {MODEL_COMPONENT!r}, the name of rl.reward_model's "
                "score: rename it"
            )
        value = settings.weight * score
        if settings.alone:
            out.append(Reward(total=value, correct=reward.correct, components={MODEL_COMPONENT: value}))
        else:
            components = {**reward.components, MODEL_COMPONENT: value}
            out.append(Reward(total=reward.total + value, correct=reward.correct, components=components))
    return out
