"""Per-token log-probabilities of the targets, and entropies, from final hidden states.

One function serves the SFT loss (cross-entropy = -log-prob) and later RL losses. Two
memory bounds hold at once:

- token chunks: each chunk's logits are recomputed in backward (activation
  checkpointing), so at most ``chunk_size x vocab`` logits exist at any time;
- vocab parallel: under tensor parallel each rank multiplies by its own vocabulary shard
  of the output weight and only per-token scalars (max, sum of exponentials, target
  logit, ``Σ p·z``) are all-reduced over ``tp`` — ``[T, V]`` is never gathered.

With ``tp_mesh=None`` the same code is the dense computation.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from torchtitan_rl.compat import all_gather_autograd


class _SumOverReplicas(torch.autograd.Function):
    """All-reduce SUM whose backward is the identity.

    Every TP rank goes on to compute the same (replicated) loss from the sum and runs its
    own backward; the gradient of a rank's summand is then exactly the incoming gradient,
    with no further communication.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _SumOverReplicas.apply(x, group)


def _logprobs_from_logits(logits, labels, vocab_start: int, group, with_entropy: bool, entropy_grad: bool = True):
    """Log-probs (and entropies) from this rank's vocabulary slice ``[C, V_local]`` of the logits.

    ``entropy_grad=False`` computes the entropy outside autograd: an entropy that is only
    reported would otherwise leave its ``[C, V]`` intermediates in the graph, never consumed by
    backward, so every chunk's would stay alive until the micro-batch's backward ends.
    """
    logits = logits.float()
    # The max only stabilizes exp(); any value per token gives the same result, so it
    # carries no gradient.
    row_max = logits.detach().max(dim=-1).values
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - row_max[:, None]
    exp = shifted.exp()
    sum_exp = _sum_over(exp.sum(dim=-1), group)
    log_normalizer = sum_exp.log()
    vocab_local = logits.shape[1]
    local_labels = labels - vocab_start
    owned = (local_labels >= 0) & (local_labels < vocab_local)
    target = shifted.gather(1, local_labels.clamp(0, vocab_local - 1)[:, None]).squeeze(1)
    target_shifted = _sum_over(torch.where(owned, target, torch.zeros_like(target)), group)
    logprobs = target_shifted - log_normalizer
    if not with_entropy:
        return logprobs, None
    if torch.is_grad_enabled() and entropy_grad:
        return logprobs, log_normalizer - _sum_over((exp * shifted).sum(dim=-1), group) / sum_exp
    with torch.no_grad():
        # Reported only: no graph, and a batched dot product instead of a [C, V] product buffer
        # (its backward is slow, so the differentiable branch above keeps mul + sum).
        expected_shifted = _sum_over((exp[:, None, :] @ shifted[:, :, None]).flatten(), group) / sum_exp
        return logprobs, log_normalizer - expected_shifted


def token_logprobs(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    tp_mesh: DeviceMesh | None = None,
    loss_parallel: bool = True,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p(labels[t]), entropy[t] or None)`` for every token, both ``[T]``, differentiable
    (the entropy only with ``entropy_grad``).

    ``hidden`` is the model's final-normed output: ``[T, D]`` on one TP rank, or this rank's
    sequence-parallel shard ``[T / tp, D]`` under tensor parallel (gathered here, with a
    reduce-scatter in backward). ``output_weight`` is the output head weight, a vocab-sharded
    DTensor under tensor parallel. ``loss_parallel=False`` gathers each chunk's logits over
    the vocabulary instead (a debugging aid: more memory, same numbers).
    """
    group = None if tp_mesh is None else tp_mesh.get_group()
    weight = output_weight.to_local() if isinstance(output_weight, DTensor) else output_weight
    vocab_start = 0
    if group is not None:
        hidden = all_gather_autograd(hidden, tp_mesh)
        vocab_start = tp_mesh.get_local_rank() * weight.shape[0]
    assert hidden.shape[0] == labels.shape[0], (hidden.shape, labels.shape)

    def chunk_fn(h, lab):
        logits = h @ weight.t()
        if group is None or loss_parallel:
            return _logprobs_from_logits(logits, lab, vocab_start, group, with_entropy, entropy_grad)
        # Debug path: gather the chunk's logits over the vocabulary, then go dense. Every
        # rank's loss is the same, and the gather's backward sums the replicated gradient
        # over ranks, so it is scaled back to count once.
        logits = all_gather_autograd(logits.t(), tp_mesh).t()
        logits = _ScaleGrad.apply(logits, 1.0 / tp_mesh.size())
        return _logprobs_from_logits(logits, lab, 0, None, with_entropy, entropy_grad)

    logprob_chunks, entropy_chunks = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        logprobs, entropy = checkpoint(chunk_fn, hidden[start:end], labels[start:end], use_reentrant=False)
        logprob_chunks.append(logprobs)
        entropy_chunks.append(entropy)
    entropy = torch.cat(entropy_chunks) if with_entropy else None
    return torch.cat(logprob_chunks), entropy


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None
