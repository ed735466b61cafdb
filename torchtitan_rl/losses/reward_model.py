"""The Bradley–Terry loss of a reward model on chosen / rejected pairs, as a function of the two
completions' scores, and its gradient as one coefficient per sequence.

With ``s_c`` and ``s_r`` a pair's scores (``engine_scores``), ``m`` its margin (the row's
``margin`` column, 0 without one) and ``σ`` the logistic function, per pair
``ℓ = −log σ(s_c − s_r − m) + λ (s_c + s_r)²``, and the loss is the mean of ℓ over the
mini-batch's pairs. The margin asks a clearer preference for a larger score gap. ``λ``
(``loss.center_rewards_coefficient``, 0 by default) pulls the scores towards mean zero, which the
Bradley–Terry term alone leaves free (it sees differences only).

The loss is nonlinear in the scores, so, as for the preference losses (``losses.preference``),
the recipe takes every score first, completes the pairs over the data-parallel ranks, and
trains on ``Σ_i c_i s_i`` with ``c_i = ∂L/∂s_i`` from here.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RewardModelLoss:
    center_coef: float = 0.0

    def __post_init__(self):
        if not 0 <= self.center_coef < float("inf"):
            raise ValueError(f"loss.center_rewards_coefficient must be a finite number >= 0, got {self.center_coef}")


def pair_losses(
    loss: RewardModelLoss, chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor
) -> torch.Tensor:
    """ℓ of every pair from its scores and margin (``[P]`` each; differentiable in the scores)."""
    return -F.logsigmoid(chosen - rejected - margins) + loss.center_coef * (chosen + rejected) ** 2


def score_coefficients(
    loss: RewardModelLoss, chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``∂L/∂s`` of every pair's chosen and of its rejected completion (float64), L being the
    mean of the pairs' losses, and L itself."""
    chosen = chosen.detach().double().requires_grad_(True)
    rejected = rejected.detach().double().requires_grad_(True)
    value = pair_losses(loss, chosen, rejected, margins.double()).mean()
    grad_chosen, grad_rejected = torch.autograd.grad(value, (chosen, rejected))
    return grad_chosen, grad_rejected, float(value.detach())


def reward_model_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """The step's metrics over its pairs: how often the chosen completion scores higher, the
    mean score difference, and the mean scores (margins or not)."""
    return {
        "rm/accuracy": float((chosen > rejected).double().mean()),
        "rm/margin": float((chosen - rejected).mean()),
        "rm/chosen": float(chosen.mean()),
        "rm/rejected": float(rejected.mean()),
    }
