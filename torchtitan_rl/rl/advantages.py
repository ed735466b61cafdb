"""Group-relative advantages of GRPO-style RL, and the unbiased pass@k estimator.

A group is the samples drawn from one prompt. For a group g of n rewards with mean m_g:

* ``grpo``: ``(r_i - m_g) / (s_g + eps)``, s_g the Bessel-corrected (n - 1) standard deviation;
* ``dr_grpo`` (Dr. GRPO, Liu et al. 2025): ``r_i - m_g``, without the std that favours easy and hard prompts;
* ``rloo``: ``r_i - mean of the other n - 1 rewards``, a baseline independent of r_i.

A singleton group has no baseline and a group whose rewards are all equal has no signal, so
both get exactly 0 under every estimator (rounding in m_g would otherwise leave ~1e-17 noise).
"""

import math

import torch

ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _check_inputs(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        shapes = f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        raise ValueError(f"rewards and group_ids must be 1-D and of one length, got {shapes}")
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be integers, got {group_ids.dtype}")
    if group_ids.numel() and int(group_ids.min()) < 0:
        raise ValueError("group_ids must be non-negative")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite")


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each sample's group as 0..G-1 (ids may be sparse and large), and G."""
    unique_ids, index = torch.unique(group_ids, return_inverse=True)
    return index, unique_ids.numel()


def _all_equal_per_sample(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    group_min = torch.full((num_groups,), math.inf, dtype=values.dtype, device=values.device)
    group_max = torch.full((num_groups,), -math.inf, dtype=values.dtype, device=values.device)
    group_min = group_min.scatter_reduce(0, index, values, reduce="amin")
    group_max = group_max.scatter_reduce(0, index, values, reduce="amax")
    return (group_min == group_max)[index]


def zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per sample: whether every reward of its group is equal (singletons included)."""
    _check_inputs(rewards, group_ids)
    return _all_equal_per_sample(rewards.to(torch.float64), *_group_index(group_ids))


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str, eps: float = 1e-6) -> torch.Tensor:
    """Float32 advantage per sample; samples of a group share a ``group_ids`` value (any order)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid ones: {ADVANTAGE_ESTIMATORS}")
    _check_inputs(rewards, group_ids)
    index, num_groups = _group_index(group_ids)
    values = rewards.to(torch.float64)
    sizes = torch.bincount(index, minlength=num_groups).to(torch.float64)
    sums = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(0, index, values)
    size, total = sizes[index], sums[index]
    deviation = values - total / size
    # clamp: singleton groups divide by 0 here; their advantage is zeroed below.
    others = (size - 1).clamp(min=1)
    if estimator == "grpo":
        squares = torch.zeros_like(sums).index_add_(0, index, deviation**2)
        std = (squares[index] / others).sqrt()
        advantages = deviation / (std + eps)
    elif estimator == "dr_grpo":
        advantages = deviation
    else:
        advantages = values - (total - values) / others
    # Singleton groups are all-equal too, so this also zeroes them.
    no_signal = _all_equal_per_sample(values, index, num_groups)
    return torch.where(no_signal, 0.0, advantages).to(torch.float32)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021).

    Evaluated as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which never forms the huge binomials.
    """
    n, c = num_samples, num_correct
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples, got k={k}, num_samples={n}")
    if not 0 <= c <= n:
        raise ValueError(f"num_correct={c} must be between 0 and num_samples={n}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
