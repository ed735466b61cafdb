"""Router auxiliary losses of mixture-of-experts layers, exact for any parallel layout
(docs/design.md, 'Mixture of experts').

The load-balancing loss of a group of tokens (Switch Transformer; the ``aux_loss`` of a
Hugging Face Qwen3-MoE export)
is ``E · Σ_e f_e · P_e`` with ``f_e = c_e / (L·N)`` the share of top-k assignments and
``P_e = q_e / (L·N)`` the mean router probability of expert e, where ``c`` counts and ``q`` sums
probabilities over the group's N real tokens and L MoE layers (``pooled``, HF), or the same
per layer and summed over layers (``sum``: ``E · Σ_l Σ_e (c_le/N)(q_le/N)``).

The counts carry no gradient, so with them fixed the loss is *linear* in the probability sums:
each rank computes a partial loss from the group's complete counts (all-reduced, no autograd
through the collective) and its own tokens' probability sums, and the partial losses and their
gradients add up over micro-batches and ranks to the group's loss, like every other term.

Scopes (``aux_loss_scope``), i.e. what a group is:

- ``global``: the whole mini-batch (one group). Its counts are only known once every
  micro-batch has been routed: with several micro-batches per rank the engine routes them all
  first in a no-grad counting pass.
- ``sequence``: every sequence is a group, and the loss is the mean over the mini-batch's
  sequences; a sequence's counts are summed over the ranks that hold its tokens (CP, TP).
- ``microbatch``: every micro-batch is a group (summed over CP / TP peers), mean over the
  micro-batches of all DP ranks; depends on the layout on purpose, like ``token_mean_legacy``.

The router z-loss is ``(1/N) Σ_t Σ_l logsumexp(logits_lt)²`` over the mini-batch's N real tokens:
a per-token mean of the sum over layers (ST-MoE; each layer adds its own term).
"""

from dataclasses import dataclass

import torch

from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.losses.reduction import NUM_MICROBATCHES, NUM_SEQS, NUM_TOKENS

AUX_LOSS_SCOPES = ("global", "sequence", "microbatch")
AUX_LOSS_LAYERS = ("pooled", "sum")


@dataclass(frozen=True)
class RouterLossConfig:
    aux_loss_coef: float = 0.0
    aux_loss_scope: str = "global"
    aux_loss_layers: str = "pooled"
    z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ValueError(f"moe.aux_loss_scope: {self.aux_loss_scope!r} is not one of {', '.join(AUX_LOSS_SCOPES)}")
        if self.aux_loss_layers not in AUX_LOSS_LAYERS:
            raise ValueError(
                f"moe.aux_loss_layers: {self.aux_loss_layers!r} is not one of {', '.join(AUX_LOSS_LAYERS)}"
            )
        for key in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, key)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"moe.{key}: must be a finite number >= 0, got {value!r}")

    @property
    def needs_global_counts(self) -> bool:
        return self.aux_loss_coef > 0 and self.aux_loss_scope == "global"


@dataclass
class RouterMetrics:
    """A MoE model's router statistics of one ``forward_backward`` on this rank: partial
    losses (unweighted; their sum over every rank is the mini-batch's loss), the top-k
    counts of this rank's tokens per MoE layer and expert and, with routing replay, the
    agreement counts (both summed over every rank at log time)."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    counts: torch.Tensor  # [L, E]
    layer_ids: tuple[int, ...]  # the model's MoE layers, in order
    config: RouterLossConfig
    # Routing replay (moe.router_replay not off): per MoE layer, (recorded top-k choices of this
    # rank's tokens that the layer's own top-k also made, recorded choices compared) [L, 2].
    agreement: torch.Tensor | None = None


def balance_loss(
    counts: torch.Tensor, prob_sums: torch.Tensor, num_tokens: torch.Tensor, weights: torch.Tensor, layers: str
) -> torch.Tensor:
    """``Σ_g w_g · E · Σ_e f_ge · P_ge`` over groups g.

    ``counts`` ``[G, L, E]``: each group's complete top-k counts (no gradient); ``prob_sums``
    ``[G, L, E]``: this rank's share of each group's probability sums; ``num_tokens`` ``[G]``:
    each group's real tokens (whole group); ``weights`` ``[G]``. Partial when ``prob_sums`` is
    a share: the shares' results add up to the loss of the whole.
    """
    assert not counts.requires_grad, "counts must not carry gradient"
    num_layers, num_experts = counts.shape[1], counts.shape[2]
    if layers == "pooled":
        per_group = (counts.sum(1) * prob_sums.sum(1)).sum(-1) / (num_layers * num_tokens.clamp(min=1)) ** 2
    else:
        per_group = (counts * prob_sums).sum((1, 2)) / num_tokens.clamp(min=1) ** 2
    # Groups without a real token (filler) have zero counts and sums: nothing to divide by.
    return num_experts * (weights * per_group).sum()


def z_loss(z_sums: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """This rank's share of the z-loss: ``z_sums`` ``[L, S]`` of its tokens over the mini-batch's
    real tokens ``num_tokens``."""
    return z_sums.sum() / num_tokens.clamp(min=1)


def partial_router_losses(
    config: RouterLossConfig,
    stats,
    mb,
    counts: torch.Tensor,
    parallel_dims,
    device: torch.device,
    expert_counts: torch.Tensor | None = None,
    mb_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial load-balancing and z losses of one micro-batch ``mb`` (its
    ``RouterStats`` ``stats``, the mini-batch's global ``counts``): each group's counts complete
    (all-reduced, no gradient), the probability sums its own.

    ``expert_counts`` (global scope) and ``mb_counts`` (the micro-batch's per-sequence counts
    ``[L, S, E]``, complete over its CP / TP peers; the other scopes) are computed from ``stats``
    when None. A pipeline stage, whose ``stats`` cover its own layers, passes them counted
    beforehand: the pooled loss reads every layer's counts."""
    num_tokens = counts[NUM_TOKENS].float()
    aux = torch.zeros((), device=device)
    if config.aux_loss_coef > 0:
        one = torch.ones(1, device=device)
        if config.aux_loss_scope == "global":
            if expert_counts is None:
                expert_counts = all_reduce(stats.counts.sum(1), "sum", parallel_dims.mesh("world"))
            aux = balance_loss(
                expert_counts[None], stats.prob_sums.sum(1)[None], num_tokens[None], one, config.aux_loss_layers
            )
        elif config.aux_loss_scope == "sequence":
            # A sequence's tokens are spread over its CP / TP peers only.
            if mb_counts is None:
                mb_counts = all_reduce(stats.counts, "sum", parallel_dims.mesh("cp_tp"))
            seq_tokens = torch.zeros(mb.num_seqs, device=device)
            seq_tokens[: len(mb.seq_lens)] = torch.tensor(mb.seq_lens, dtype=torch.float32)
            weights = torch.ones(mb.num_seqs, device=device) / counts[NUM_SEQS].clamp(min=1)
            aux = balance_loss(
                mb_counts.transpose(0, 1), stats.prob_sums.transpose(0, 1), seq_tokens, weights, config.aux_loss_layers
            )
        else:
            if mb_counts is None:
                mb_counts = all_reduce(stats.counts, "sum", parallel_dims.mesh("cp_tp"))
            mb_tokens = torch.tensor([float(sum(mb.seq_lens))], device=device)
            aux = balance_loss(
                mb_counts.sum(1)[None],
                stats.prob_sums.sum(1)[None],
                mb_tokens,
                one / counts[NUM_MICROBATCHES].clamp(min=1),
                config.aux_loss_layers,
            )
    z = z_loss(stats.z_sums, num_tokens) if config.z_loss_coef > 0 else torch.zeros((), device=device)
    return aux, z
