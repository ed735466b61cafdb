"""Per-token log-probabilities of the targets, and entropies, from final hidden states.

Two entry points share one chunk computation:

- ``token_loss`` (training): ``Σ_chunks loss_of_chunk(logprobs, entropies)`` and its gradient
  with respect to the hidden states and the output weight, both computed chunk by chunk
  during the forward pass. This works because every loss here is a sum of per-token terms
  (docs/design.md, 'Loss weights'): a chunk's share of the loss, and so its gradient, depends on that chunk's
  tokens only. A chunk's ``[C, V]`` logits become its logit gradient in place and are freed
  before the next chunk, so backward recomputes nothing and at most ``chunk_size x vocab``
  logits exist at any time.
- ``token_logprobs`` (no gradient): the same per-token values, for rollouts and evaluation.

Both are vocab parallel: under tensor parallel each rank multiplies by its own vocabulary
shard of the output weight and only per-token scalars (max, sum of exponentials, target
logit, ``Σ p·z``) are all-reduced over ``tp`` — ``[T, V]`` is never gathered. With
``tp_mesh=None`` the same code is the dense computation.

The logit gradient is written out rather than left to autograd, which would keep several
``[C, V]`` buffers per chunk: with ``g_t = ∂L/∂log p_t`` and ``e_t = ∂L/∂H_t`` (from autograd
on the loss's small per-token graph), ``∂L/∂z_tv = g_t·[v = y_t] − p_tv·(g_t + e_t·(log p_tv + H_t))``.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan_rl.compat import all_gather, all_gather_autograd

# (start, end, logprobs [C], entropies [C] or None) -> the chunk's share of the loss, a scalar.
ChunkLoss = Callable[[int, int, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


@dataclass
class _ChunkSoftmax:
    """One chunk's softmax over this rank's vocabulary slice, normalized over the whole vocabulary."""

    logprobs: torch.Tensor  # [C]
    entropy: torch.Tensor | None  # [C]
    probs: torch.Tensor  # [C, V_local]
    shifted: torch.Tensor | None  # [C, V_local] logits minus their row max; kept only with the entropy
    log_normalizer: torch.Tensor  # [C], log Σ exp(shifted)
    local_labels: torch.Tensor  # [C] labels as columns of this slice (clamped)
    owned: torch.Tensor  # [C] True where this slice holds the label

    @staticmethod
    def of(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group, with_entropy: bool) -> "_ChunkSoftmax":
        # A float32 buffer of our own: every step below works in place on it.
        shifted = logits.float() if logits.dtype != torch.float32 else logits
        # The max only stabilizes exp(); any value per token gives the same result.
        row_max = _all_reduce(shifted.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted.sub_(row_max[:, None])
        vocab_local = shifted.shape[1]
        local_labels = (labels - vocab_start).clamp(0, vocab_local - 1)
        owned = (labels >= vocab_start) & (labels < vocab_start + vocab_local)
        target = shifted.gather(1, local_labels[:, None]).squeeze(1)
        target = _all_reduce(torch.where(owned, target, torch.zeros_like(target)), dist.ReduceOp.SUM, group)
        probs = shifted.exp() if with_entropy else shifted.exp_()
        sum_exp = _all_reduce(probs.sum(dim=-1), dist.ReduceOp.SUM, group)
        log_normalizer = sum_exp.log()
        probs.div_(sum_exp[:, None])
        entropy = None
        if with_entropy:
            # H = log Σ exp(z) − Σ p·z, with a batched dot product instead of a [C, V] product.
            expected = _all_reduce((probs[:, None, :] @ shifted[:, :, None]).flatten(), dist.ReduceOp.SUM, group)
            entropy = log_normalizer - expected
        return _ChunkSoftmax(
            target - log_normalizer,
            entropy,
            probs,
            shifted if with_entropy else None,
            log_normalizer,
            local_labels,
            owned,
        )

    def logit_grad(self, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None) -> torch.Tensor:
        """``∂L/∂z`` for this slice, ``[C, V_local]`` float32, built in place of the chunk's buffers."""
        if grad_entropy is None:
            grad = self.probs.mul_(-grad_logprobs[:, None])
        else:
            log_probs = self.shifted.sub_(self.log_normalizer[:, None])
            factor = log_probs.add_(self.entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logprobs[:, None])
            grad = factor.mul_(self.probs).neg_()
        at_label = torch.where(self.owned, grad_logprobs, torch.zeros_like(grad_logprobs))
        return grad.scatter_add_(1, self.local_labels[:, None], at_label[:, None])


class _VocabLayout:
    """Where this rank's logits live: its weight shard, the hidden states of every token the
    shard scores (gathered over ``tp``, differentiably), and the shard's first vocabulary id."""

    def __init__(
        self, hidden: torch.Tensor, output_weight: torch.Tensor, tp_mesh: DeviceMesh | None, loss_parallel: bool
    ):
        self.tp_mesh = tp_mesh
        self.group = None if tp_mesh is None else tp_mesh.get_group()
        self.loss_parallel = loss_parallel
        self.weight = output_weight.to_local() if isinstance(output_weight, DTensor) else output_weight
        self.vocab_start = 0
        self.hidden = hidden
        if self.group is not None:
            self.hidden = all_gather_autograd(hidden, tp_mesh)
            self.vocab_start = tp_mesh.get_local_rank() * self.weight.shape[0]

    def softmax(self, start: int, end: int, labels: torch.Tensor, with_entropy: bool) -> _ChunkSoftmax:
        logits = self.hidden[start:end].detach() @ self.weight.detach().t()
        if self.group is None or self.loss_parallel:
            return _ChunkSoftmax.of(logits, labels, self.vocab_start, self.group, with_entropy)
        # Debug path: gather the chunk's logits over the vocabulary, then go dense (same numbers).
        logits = all_gather(logits.t().contiguous(), self.tp_mesh).t()
        return _ChunkSoftmax.of(logits, labels, 0, None, with_entropy)

    def local_columns(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of a chunk's logit gradient."""
        if self.group is None or self.loss_parallel:
            return grad_logits
        return grad_logits.narrow(1, self.tp_mesh.get_local_rank() * self.weight.shape[0], self.weight.shape[0])


@torch.no_grad()
def token_logprobs(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    tp_mesh: DeviceMesh | None = None,
    loss_parallel: bool = True,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log p(labels[t]), entropy[t] or None)`` for every token, both ``[T]``, without gradient.

    ``hidden`` is the model's final-normed output: ``[T, D]`` on one TP rank, or this rank's
    sequence-parallel shard ``[T / tp, D]`` under tensor parallel. ``output_weight`` is the
    output head weight, a vocab-sharded DTensor under tensor parallel. ``loss_parallel=False``
    gathers each chunk's logits over the vocabulary instead (a debugging aid: more memory,
    same numbers).
    """
    layout = _VocabLayout(hidden, output_weight, tp_mesh, loss_parallel)
    assert layout.hidden.shape[0] == labels.shape[0], (layout.hidden.shape, labels.shape)
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, labels.shape[0], chunk_size):
        softmax = layout.softmax(start, start + chunk_size, labels[start : start + chunk_size], with_entropy)
        logprob_chunks.append(softmax.logprobs)
        entropy_chunks.append(softmax.entropy)
    return torch.cat(logprob_chunks), torch.cat(entropy_chunks) if with_entropy else None


def token_loss(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    loss_of_chunk: ChunkLoss,
    tp_mesh: DeviceMesh | None = None,
    loss_parallel: bool = True,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    backward_twice: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(loss, logprobs, entropies or None)``: the loss ``Σ_chunks loss_of_chunk(start, end,
    logprobs[start:end], entropies[start:end])``, differentiable with respect to ``hidden`` and
    ``output_weight``, and the per-token values (``[T]``, detached) for metrics.

    Arguments as for ``token_logprobs``. ``loss_of_chunk`` must be a sum of per-token terms
    and sees differentiable log-probs (and entropies with ``entropy_grad``; otherwise they
    are reported only). The gradients are taken chunk by chunk here, during the forward pass,
    and handed to autograd whole: backward through the loss costs two multiplies.
    ``backward_twice``: keep them for a second backward through the loss (zero-bubble pipeline
    schedules take the input gradients and the weight gradients in separate passes); otherwise
    they are freed as soon as backward has used them.
    """
    layout = _VocabLayout(hidden, output_weight, tp_mesh, loss_parallel)
    hidden, weight = layout.hidden, layout.weight
    assert hidden.shape[0] == labels.shape[0], (hidden.shape, labels.shape)
    grad_hidden = torch.zeros_like(hidden) if hidden.requires_grad else None
    # Summed over chunks in float32 even when the weight is low precision.
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, labels.shape[0], chunk_size):
        end = min(start + chunk_size, labels.shape[0])
        with torch.no_grad():
            softmax = layout.softmax(start, end, labels[start:end], with_entropy)
        leaves = [softmax.logprobs.requires_grad_()]
        entropy = softmax.entropy
        if with_entropy and entropy_grad:
            leaves.append(entropy.requires_grad_())
        with torch.enable_grad():
            chunk_loss = loss_of_chunk(start, end, softmax.logprobs, entropy)
        if chunk_loss.requires_grad:
            grads = torch.autograd.grad(chunk_loss, leaves, allow_unused=True, materialize_grads=True)
        else:
            grads = [torch.zeros_like(leaf) for leaf in leaves]
        with torch.no_grad():
            grad_logits = layout.local_columns(softmax.logit_grad(grads[0], grads[1] if len(grads) > 1 else None))
            del softmax  # its [C, V] buffers now hold grad_logits
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits.to(weight.dtype) @ weight.detach()
            if grad_weight is not None:
                grad_weight += grad_logits.t().to(hidden.dtype) @ hidden[start:end].detach()
        loss += chunk_loss.detach()
        logprob_chunks.append(leaves[0].detach())
        entropy_chunks.append(entropy.detach() if with_entropy else None)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    loss = _WithGradients.apply(loss, hidden, weight, grad_hidden, grad_weight, backward_twice)
    return loss, torch.cat(logprob_chunks), torch.cat(entropy_chunks) if with_entropy else None


class _WithGradients(torch.autograd.Function):
    """``loss`` (already computed) made differentiable with respect to ``hidden`` and ``weight``
    through their gradients (already computed): backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, grad_hidden, grad_weight, backward_twice):
        ctx.grads = (grad_hidden, grad_weight)
        ctx.backward_twice = backward_twice
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_hidden, grad_weight = ctx.grads
        if not ctx.backward_twice:
            del ctx.grads  # backward runs once; free the [T, D] and [V, D] buffers right away
        scale = lambda g: None if g is None else g * grad.to(g.dtype)  # noqa: E731
        return None, scale(grad_hidden), scale(grad_weight), None, None, None
