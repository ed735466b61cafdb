"""Preference losses of chosen / rejected pairs (DPO, IPO, SimPO) as functions of whole-sequence
log-prob sums, and their gradient as one coefficient per sequence.

Each loss is nonlinear in ``S = Σ_t logp_θ(y_t)`` over a completion's tokens, so no per-token
weight written before the forward can give its gradient. But its gradient is linear in the
per-token gradients: ``∇L = Σ_i (∂L/∂S_i) ∇S_i``. The preference recipe therefore takes the
sums first (a gradient-free forward, every token of every sequence, whichever micro-batch or
context-parallel rank holds it), brings each pair's two sums together over the data-parallel
ranks, and computes here ``c_i = ∂L/∂S_i``; the update's forward-backward is then the plain
weighted sum ``Σ_i c_i Σ_t logp_θ(y_t)``, which the engine reduces exactly under any layout.

With ``h = (S_c − R_c) − (S_r − R_r)`` (``R``: the reference policy's sums), ``n`` the completion's
token count, ``σ`` the logistic function and ``ε`` the label smoothing, per pair:

| loss    | ℓ                                                                  |
|---------|--------------------------------------------------------------------|
| `dpo`   | −(1 − ε) log σ(β h) − ε log σ(−β h)   (ε > 0: conservative DPO)     |
| `ipo`   | ((S_c − R_c)/n_c − (S_r − R_r)/n_r − 1/(2β))²                      |
| `simpo` | −(1 − ε) log σ(β (S_c/n_c − S_r/n_r) − γ) − ε log σ(−β (…) + γ)   |

and the loss is the mean of ℓ over the mini-batch's pairs, plus, with ``nll_coef`` λ > 0, λ times
the chosen completions' negative log-likelihood per token, −Σ S_c / Σ n_c over the mini-batch
(RPO: it keeps the chosen answers likely). SimPO needs no reference. The
implicit rewards (``rewards/*``) are ``β (S − R)`` (DPO, IPO) and ``β S / n`` (SimPO).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.sample import Sample

PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")


@dataclass(frozen=True)
class PreferenceLoss:
    name: str
    beta: float
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    nll_coef: float = 0.0

    def __post_init__(self):
        if self.name not in PREFERENCE_LOSSES:
            raise ValueError(f"loss.loss_fn: {self.name!r} is not a preference loss ({', '.join(PREFERENCE_LOSSES)})")
        if not self.beta > 0:
            raise ValueError(f"loss.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"loss.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if not self.nll_coef >= 0:
            raise ValueError(f"loss.nll_coef must be >= 0, got {self.nll_coef}")
        if self.label_smoothing and self.name == "ipo":
            raise ValueError("loss.label_smoothing: only the dpo and simpo losses smooth their labels, not ipo")

    @property
    def needs_reference(self) -> bool:
        return self.name != "simpo"


def preference_loss_from_config(loss_config) -> PreferenceLoss:
    """The ``[loss]`` section's preference loss; a ValueError naming the key when it is none or
    a value is out of range."""
    if loss_config.loss_fn not in PREFERENCE_LOSSES:
        raise ValueError(
            f"loss.loss_fn: job.recipe = 'dpo' trains a preference loss; choose one of "
            f"{', '.join(PREFERENCE_LOSSES)}, not {loss_config.loss_fn!r}"
        )
    return PreferenceLoss(
        loss_config.loss_fn,
        loss_config.beta,
        loss_config.label_smoothing,
        loss_config.simpo_gamma,
        loss_config.nll_coef,
    )


@dataclass
class PairSums:
    """Per pair of the mini-batch (float64 vectors ``[P]``): the policy's and the reference's
    log-prob sums over each completion's loss tokens, and those token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_ref: torch.Tensor
    rejected_ref: torch.Tensor
    num_chosen: torch.Tensor
    num_rejected: torch.Tensor

    ROWS = ("chosen", "rejected", "chosen_ref", "rejected_ref", "num_chosen", "num_rejected")

    @classmethod
    def from_table(cls, table: torch.Tensor) -> "PairSums":
        """From ``table[len(ROWS), P]``, its rows in ``ROWS`` order."""
        return cls(*table)


def _smoothed_logistic(x: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(x) - label_smoothing * F.logsigmoid(-x)


def pair_losses(loss: PreferenceLoss, sums: PairSums) -> torch.Tensor:
    """ℓ of every pair (differentiable in ``sums.chosen`` and ``sums.rejected``)."""
    if loss.name == "dpo":
        h = (sums.chosen - sums.chosen_ref) - (sums.rejected - sums.rejected_ref)
        return _smoothed_logistic(loss.beta * h, loss.label_smoothing)
    if loss.name == "ipo":
        chosen = (sums.chosen - sums.chosen_ref) / sums.num_chosen.clamp(min=1)
        rejected = (sums.rejected - sums.rejected_ref) / sums.num_rejected.clamp(min=1)
        return (chosen - rejected - 1 / (2 * loss.beta)) ** 2
    margin = sums.chosen / sums.num_chosen.clamp(min=1) - sums.rejected / sums.num_rejected.clamp(min=1)
    return _smoothed_logistic(loss.beta * margin - loss.simpo_gamma, loss.label_smoothing)


def implicit_rewards(loss: PreferenceLoss, sums: PairSums) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected completions' implicit rewards of every pair."""
    if loss.name == "simpo":
        return (
            loss.beta * sums.chosen / sums.num_chosen.clamp(min=1),
            loss.beta * sums.rejected / sums.num_rejected.clamp(min=1),
        )
    return loss.beta * (sums.chosen - sums.chosen_ref), loss.beta * (sums.rejected - sums.rejected_ref)


def sequence_coefficients(loss: PreferenceLoss, sums: PairSums) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``∂L/∂S`` of every pair's chosen and of its rejected completion, and L: the mean of the
    pairs' losses, plus ``nll_coef`` times the chosen completions' negative log-likelihood per
    token (over every chosen token of the mini-batch)."""
    chosen = sums.chosen.detach().double().requires_grad_(True)
    rejected = sums.rejected.detach().double().requires_grad_(True)
    value = pair_losses(loss, PairSums(chosen, rejected, *(t.double() for t in _rest(sums)))).mean()
    if loss.nll_coef:
        value = value - loss.nll_coef * chosen.sum() / sums.num_chosen.double().sum().clamp(min=1)
    grad_chosen, grad_rejected = torch.autograd.grad(value, (chosen, rejected))
    return grad_chosen, grad_rejected, float(value.detach())


def _rest(sums: PairSums) -> tuple[torch.Tensor, ...]:
    return sums.chosen_ref, sums.rejected_ref, sums.num_chosen, sums.num_rejected


def preference_metrics(loss: PreferenceLoss, sums: PairSums) -> dict[str, float]:
    """The step's metrics over its pairs, under TRL's names; with ``nll_coef`` also the chosen
    completions' NLL per token (``nll_loss``, before its coefficient)."""
    chosen, rejected = implicit_rewards(loss, sums)
    metrics = {
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        "rewards/accuracies": float((chosen > rejected).double().mean()),
        "rewards/margins": float((chosen - rejected).mean()),
        "logps/chosen": float(sums.chosen.mean()),
        "logps/rejected": float(sums.rejected.mean()),
    }
    if loss.nll_coef:
        metrics["nll_loss"] = float(-sums.chosen.double().sum() / sums.num_chosen.double().sum().clamp(min=1))
    return metrics


def pair_sums(
    samples: list[Sample],
    policy: list[torch.Tensor],
    reference: list[torch.Tensor] | None,
    num_pairs: int,
    batch_mesh: DeviceMesh | None,
) -> PairSums:
    """Every pair's log-prob sums over its completions' loss tokens (``policy`` / ``reference``:
    each sample's per-token log-probs) and their token counts, summed over the data-parallel
    ranks of ``batch_mesh``, which hold different samples (collective)."""
    values = torch.zeros(len(samples), 3, dtype=torch.float64)  # per sample: S, R, n
    for i, sample in enumerate(samples):
        mask = sample.loss_mask
        values[i, 0] = policy[i][mask].double().sum()
        if reference is not None:
            values[i, 1] = reference[i][mask].double().sum()
        values[i, 2] = float(mask.sum())
    (chosen, chosen_ref, num_chosen), (rejected, rejected_ref, num_rejected) = exchange_pairs(
        samples, values, num_pairs, batch_mesh
    )
    return PairSums(chosen, rejected, chosen_ref, rejected_ref, num_chosen, num_rejected)


def exchange_pairs(
    samples: list[Sample], values: torch.Tensor, num_pairs: int, batch_mesh: DeviceMesh | None
) -> torch.Tensor:
    """Per side (chosen, then rejected), value and pair of the mini-batch (float64 ``[2, k, P]``):
    each of this rank's samples' ``values`` (float64 ``[len(samples), k]``) at its pair
    (``group_id``) and side (``preferred``), brought together over the data-parallel ranks of
    ``batch_mesh``, which hold different samples (collective). A RuntimeError unless every pair
    has one completion of each side over all ranks."""
    table = torch.zeros(2, values.shape[1] + 1, num_pairs, dtype=torch.float64)
    for sample, row in zip(samples, values, strict=True):
        side = 0 if sample.preferred else 1
        table[side, :-1, sample.group_id] += row
        table[side, -1, sample.group_id] += 1  # completions of this side: one per pair on all ranks together
    if batch_mesh is not None:
        dist.all_reduce(table, group=batch_mesh.get_group())
    counts = table[:, -1]
    if not bool((counts == 1).all()):
        pair = int((counts != 1).any(0).nonzero()[0])
        raise RuntimeError(
            f"pair {pair} of the mini-batch has {int(counts[0, pair])} chosen and {int(counts[1, pair])} rejected "
            "completions over all ranks; every pair has one of each"
        )
    return table[:, :-1]
