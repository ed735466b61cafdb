"""The rollout-correction weight of each token, from the log-ratio ``log ρ = log π_prox −
log π_behave`` of the proximal policy to the sampler (``rl/rollout_correction.py`` explains the
modes). Shared by the two places that weigh tokens: the recipe, from recomputed proximal
log-probs, and the engine's loss pass, when the proximal policy is the one being trained
(``current_proximal``) and its log-probs are the pass's own.
"""

from dataclasses import dataclass

import torch

# log(p_θ / q) is clamped to ±20 before exp (e^20 ≈ 5e8): a stale or mismatched sampler
# log-prob cannot overflow a ratio, and the clamp sits far outside any clip range.
MAX_LOG_RATIO = 20.0
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

    @property
    def per_sequence(self) -> bool:
        """Whether a token's weight depends on its whole sequence (its sums come first)."""
        return self.level == "sequence" or self.mode == "geo_mask"


def sequence_log_ratio(config: RolloutCorrection, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A sequence's log-ratio from the sum of its loss tokens' ``log ρ`` and their count:
    the sum (``log Π_t ρ_t``), or for geo_mask the mean (the log of the geometric mean)."""
    return sums / counts.clamp(min=1) if config.mode == "geo_mask" else sums


def weights_of(config: RolloutCorrection, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token weights (float32, 0 off ``mask``) from each token's ``log_ratio``: its own
    ``log ρ_t``, or with ``per_sequence`` its sequence's (``sequence_log_ratio``)."""
    if config.mode == "geo_mask":
        ratio = log_ratio.exp()
        keep = (config.min_ratio <= ratio) & (ratio <= config.max_ratio)
        return torch.where(mask & keep, 1.0, 0.0).float()
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
