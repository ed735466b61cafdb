"""Rollout correction: per-token weights for the gap between the policy that sampled the
rollouts (behaviour, ``sampler_logprobs``) and the proximal policy the update starts from
(``prox_logprobs``, recomputed by the trainer).

The two differ because inference and training kernels disagree (a bf16 sampler against an
fp32 trainer, other attention kernels) and, in asynchronous RL, because the sampler's weights
are older. With ``ρ_t = π_prox(y_t) / π_behave(y_t)`` over a sequence's loss tokens, and ``ρ``
either that per token (level "token") or the sequence's product ``Π_t ρ_t`` given to each of
its tokens (level "sequence"), the weight multiplying each token's policy term is

| mode       | weight                                                                    |
|------------|---------------------------------------------------------------------------|
| `none`     | 1 (no correction)                                                         |
| `tis`      | min(ρ, max) (truncated importance sampling)                               |
| `mis`      | ρ where ρ <= max, else 0 (masked importance sampling)                      |
| `icepop`   | ρ where min <= ρ <= max, else 0 (IcePop: both tails masked)                |
| `geo_mask` | 1 where min <= exp(mean_t log ρ_t) <= max over the sequence, else 0        |

A weight of 0 masks the token: it keeps its place in the reduction's counts (the loss's
normalization does not depend on the correction) but contributes no gradient. Weights depend
only on a sample's own log-probs, so they are the same for any parallel layout; the metrics
are sums over every sample of the step (``rl/rollout_corr/*``).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.losses.loss_fns import MAX_LOG_RATIO

ROLLOUT_CORRECTIONS = ("none", "tis", "mis", "icepop", "geo_mask")
CORRECTION_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class RolloutCorrection:
    mode: str = "none"
    level: str = "token"
    max_ratio: float = 2.0
    min_ratio: float = 0.5

    def __post_init__(self):
        if self.mode not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rl.rollout_correction: {self.mode!r} is not one of {', '.join(ROLLOUT_CORRECTIONS)}")
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(
                f"rl.rollout_correction_level: {self.level!r} is not one of {', '.join(CORRECTION_LEVELS)}"
            )
        if not 0 <= self.min_ratio < self.max_ratio:
            raise ValueError(
                f"rl.rollout_correction_min={self.min_ratio} and rl.rollout_correction_max={self.max_ratio}: "
                "need 0 <= min < max"
            )


def log_ratios(sample: Sample) -> torch.Tensor:
    """``log ρ_t = log π_prox − log π_behave`` per token, float64, 0 off the loss mask."""
    return torch.where(sample.loss_mask, sample.prox_logprobs.double() - sample.sampler_logprobs.double(), 0.0)


def correction_weights(
    sample: Sample, config: RolloutCorrection, log_ratio: torch.Tensor | None = None
) -> torch.Tensor:
    """The sample's per-token weights ``[n]`` (float32; 0 off the loss mask), from its
    ``log_ratios`` (computed here unless given)."""
    mask = sample.loss_mask
    log_ratio = log_ratios(sample) if log_ratio is None else log_ratio
    if config.mode == "geo_mask":
        mean = log_ratio.sum() / mask.sum().clamp(min=1)
        keep = (config.min_ratio <= mean.exp()) & (mean.exp() <= config.max_ratio)
        return torch.where(mask & keep, 1.0, 0.0).float()
    if config.level == "sequence":
        log_ratio = torch.where(mask, log_ratio.sum(), 0.0)
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    if config.mode == "tis":
        weights = ratio.clamp(max=config.max_ratio)
    elif config.mode == "mis":
        weights = torch.where(ratio <= config.max_ratio, ratio, 0.0)
    elif config.mode == "icepop":
        weights = torch.where((config.min_ratio <= ratio) & (ratio <= config.max_ratio), ratio, 0.0)
    else:
        assert config.mode == "none", config.mode
        weights = torch.ones_like(ratio)
    return torch.where(mask, weights, 0.0).float()


# Sums over the step's samples, reduced over the `batch` mesh (CP / TP peers hold copies).
_SUMS = ("loss_tokens", "weight", "weight_sq", "masked_tokens", "sequences", "masked_sequences", "k1", "k3")


def apply_rollout_correction(
    samples: list[Sample], config: RolloutCorrection, batch_mesh: DeviceMesh | None
) -> dict[str, float]:
    """Set every sample's ``rollout_weights``; return the step's ``rl/rollout_corr/*`` metrics
    (one sum and one max all-reduce over ``batch_mesh``).

    Metrics over loss tokens: the weights' mean and max, the fraction masked (weight 0) and
    of sequences with a masked token, the effective sample size ``(Σw)² / (N Σw²)`` of the
    weights, and KL(π_behave ‖ π_prox) estimated from the sampled tokens, ``k1`` = −log ρ and
    ``k3`` = ρ − 1 − log ρ (per token).
    """
    sums = dict.fromkeys(_SUMS, 0.0)
    largest = 0.0
    for sample in samples:
        log_ratio = log_ratios(sample)
        weights = correction_weights(sample, config, log_ratio)
        sample.rollout_weights = weights
        mask = sample.loss_mask
        if not mask.any():
            continue
        w = weights[mask].double()
        log_ratio = log_ratio[mask].clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        sums["loss_tokens"] += w.numel()
        sums["weight"] += float(w.sum())
        sums["weight_sq"] += float(w.square().sum())
        sums["masked_tokens"] += float((w == 0).sum())
        sums["sequences"] += 1
        sums["masked_sequences"] += float((w == 0).any())
        sums["k1"] += float((-log_ratio).sum())
        sums["k3"] += float((torch.expm1(log_ratio) - log_ratio).sum())
        largest = max(largest, float(w.max()))
    values = torch.tensor(list(sums.values()), dtype=torch.float64)
    maximum = torch.tensor([largest], dtype=torch.float64)
    if batch_mesh is not None:
        dist.all_reduce(values, group=batch_mesh.get_group())
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=batch_mesh.get_group())
    total = dict(zip(_SUMS, values.tolist()))
    tokens = max(total["loss_tokens"], 1.0)
    return {
        "rl/rollout_corr/weight_mean": total["weight"] / tokens,
        "rl/rollout_corr/weight_max": maximum.item(),
        "rl/rollout_corr/masked_fraction_token": total["masked_tokens"] / tokens,
        "rl/rollout_corr/masked_fraction_seq": total["masked_sequences"] / max(total["sequences"], 1.0),
        "rl/rollout_corr/ess": total["weight"] ** 2 / (tokens * total["weight_sq"]) if total["weight_sq"] else 0.0,
        "rl/rollout_corr/kl_k1": total["k1"] / tokens,
        "rl/rollout_corr/kl_k3": total["k3"] / tokens,
    }
