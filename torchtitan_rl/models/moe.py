"""Mixture-of-experts feed-forward in the Qwen3-MoE layout, plain single-device PyTorch.

A top-k softmax router picks ``top_k`` of ``num_experts`` SwiGLU experts per token; every token
is computed (dropless, no capacity factor). Each layer also returns per-sequence router
statistics (``RouterStats``) from which router losses are computed outside the model: they are
returned by the forward, never kept in module buffers, so they compose with activation
checkpointing and with any split of the tokens over micro-batches and ranks.

Routing replay: a layer can be given the experts a sampler chose for each token (``replayed``)
and use them instead of its own top-k. Only the choice is replayed: the weights of the chosen
experts are still the router's probabilities of this forward (renormalized like its own
choice), so the router keeps its gradient, and the statistics count the experts used. The layer
also reports how many of the recorded choices its own top-k would have made (``agreement``).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EXPERTS_IMPL_CHOICES = ("auto", "grouped_mm", "loop")

# Initial std of freshly built modules (the model's init_weights overrides it).
_DEFAULT_INIT_STD = 0.02


@dataclass
class RouterStats:
    """Router statistics of one micro-batch, every MoE layer stacked in layer order.

    L = number of MoE layers, S = number of sequences of the micro-batch (``num_seqs``, the
    padding pseudo-sequence included), E = number of experts. Only real tokens (router mask
    true) enter any of them; padding is routed and computed but counted nowhere.

    counts     [L, S, E] float32, no grad: top-k assignments of sequence s's tokens to expert e
               (each token adds 1 to each of its ``top_k`` experts).
    prob_sums  [L, S, E] float32, differentiable: sum over sequence s's tokens of the softmax
               router probability of expert e (all experts, not only the chosen ones).
    z_sums     [L, S] float32, differentiable: sum over sequence s's tokens of
               logsumexp(router logits)^2 (the z-loss numerator).
    agreement  [L, 2] float32, no grad: (recorded top-k choices of real tokens that the layer's
               own top-k also made, recorded choices compared); zeros without replayed experts.
    experts    [L, T, k] int64: the experts each token of this rank's residual stream used, when
               the forward was asked to record them (``record_routing``), else None.
    """

    counts: torch.Tensor
    prob_sums: torch.Tensor
    z_sums: torch.Tensor
    agreement: torch.Tensor
    experts: torch.Tensor | None = None


class TopKRouter(nn.Module):
    """Linear router ``weight [E, dim]``; ``route`` turns its logits into the softmax (fp32),
    the top-k experts and their weights, renormalized to sum to 1 with ``norm_topk_prob``
    (Qwen3-MoE's gate).

    ``forward`` is the linear alone and returns one tensor, so that tensor-parallel styles
    (which wrap a module's single output, e.g. ``SequenceParallel``) apply to this module.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.trunc_normal_(self.weight, std=_DEFAULT_INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, E]`` in x's dtype."""
        return F.linear(x, self.weight)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [T, E] fp32, top_weights [T, k] in the logits' dtype, top_experts [T, k]
        int64)``; top experts in decreasing probability."""
        # fp32 softmax even for bf16 activations: near-equal probabilities decide the top-k.
        probs = torch.softmax(logits.float(), dim=-1)
        top_weights, top_experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return probs, top_weights.to(logits.dtype), top_experts

    def replay(
        self, probs: torch.Tensor, own_experts: torch.Tensor, replayed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top_weights [T, k] fp32, top_experts [T, k])`` with the ``replayed`` experts
        ``[T, k]`` (a negative row: no record, the token keeps ``own_experts``). The weights are
        ``probs`` at the replayed experts, renormalized with ``norm_topk_prob``: for a token whose
        record equals its own top-k they are exactly the values ``route`` gives."""
        replayed = replayed.long()
        experts = torch.where(replayed[:, :1] >= 0, replayed, own_experts)
        weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    @torch.no_grad()
    def agreement(self, own_experts: torch.Tensor, replayed: torch.Tensor, router_mask: torch.Tensor) -> torch.Tensor:
        """``[2]``: (recorded choices of the tokens in ``router_mask`` that ``own_experts`` also
        holds, recorded choices compared); a negative row of ``replayed`` is no record."""
        replayed = replayed.long()
        compared = (replayed[:, 0] >= 0) & router_mask
        matched = (own_experts[:, :, None] == replayed[:, None, :]).any(-1).sum(-1)
        return torch.stack([torch.where(compared, matched, 0).sum().float(), compared.sum().float() * self.top_k])


def grouped_mm_supported(dtype: torch.dtype, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` can run these experts: it has fp32 and bf16 kernels only,
    and needs every row stride (a feature size times the element size) to be a multiple of
    16 bytes, in forward and backward."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all(dim * itemsize % 16 == 0 for dim in dims)


class _DenseGrad(torch.autograd.Function):
    """Identity on ``[N, dim]`` whose backward gives the upstream gradient row-major strides
    ``(dim, 1)``: ``_grouped_mm``'s backward rejects any other, e.g. the zero strides of
    ``y.sum().backward()``, and ``.contiguous()`` keeps odd strides where it may (empty or
    single-row tensors count as contiguous whatever their strides)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == (grad.shape[1], 1):
            return grad
        return torch.empty(grad.shape, dtype=grad.dtype, device=grad.device).copy_(grad)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts ``w2(silu(w1 x) * w3 x)`` with stacked weights
    ``w1, w3 [E, hidden, dim]`` and ``w2 [E, dim, hidden]`` (each expert's slice is an
    ``nn.Linear`` weight, as HF stores it per expert).

    ``impl``: ``grouped_mm`` (one ``torch._grouped_mm`` per projection over the expert-sorted
    tokens, no host sync), ``loop`` (one matmul per expert, the reference; any dtype, syncs
    for the token counts), ``auto`` (grouped_mm where supported, see ``grouped_mm_supported``).
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, impl: str = "auto"):
        super().__init__()
        if impl not in EXPERTS_IMPL_CHOICES:
            raise ValueError(f"unknown experts impl {impl!r}; valid: {', '.join(EXPERTS_IMPL_CHOICES)}")
        self.impl = impl
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        for weight in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(weight, std=_DEFAULT_INIT_STD)

    def resolve_impl(self, dtype: torch.dtype) -> str:
        """The kernel a forward in ``dtype`` uses; ValueError if ``grouped_mm`` was asked for but cannot run."""
        _, hidden_dim, dim = self.w1.shape
        supported = grouped_mm_supported(dtype, dim, hidden_dim)
        if self.impl == "auto":
            return "grouped_mm" if supported else "loop"
        if self.impl == "grouped_mm" and not supported:
            raise ValueError(
                f"experts_impl='grouped_mm' cannot run {dtype} experts of dim {dim}, hidden {hidden_dim}: "
                "torch._grouped_mm needs float32/bfloat16 and feature sizes of a multiple of 16 bytes "
                "(use 'auto' or 'loop')"
            )
        return self.impl

    # Runs eagerly inside compiled blocks (distributed/compile.py): the grouped matmul has no
    # float32 fake-tensor kernel on CPU, and tokens are split by data-dependent counts.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x [N, dim]``: tokens sorted by expert, ``tokens_per_expert [E]`` (int, summing to N)
        of them per expert in order. Returns each token's expert output ``[N, dim]`` in x's dtype.
        An expert without tokens gets a zero gradient."""
        if x.dtype != self.w1.dtype:
            # The kernels would fail or cast; a silent cast (e.g. to bf16) would change the numbers.
            raise ValueError(f"expert input is {x.dtype} but the expert weights are {self.w1.dtype}")
        # The block of the stack this rank holds (all of it without expert parallel); a
        # sharded tensor type exposes it as ``to_local()``, duck-typed to keep this file free
        # of parallelism imports.
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        if self.resolve_impl(x.dtype) == "grouped_mm":
            return self._grouped_mm(x, tokens_per_expert, w1, w2, w3)
        return self._loop(x, tokens_per_expert, w1, w2, w3)

    @staticmethod
    def _grouped_mm(x, tokens_per_expert, w1, w2, w3) -> torch.Tensor:
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        gate = torch._grouped_mm(x.contiguous(), w1.transpose(-2, -1), offs=offsets)
        up = torch._grouped_mm(x.contiguous(), w3.transpose(-2, -1), offs=offsets)
        hidden = F.silu(gate) * up
        out = torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)
        return _DenseGrad.apply(out)

    @staticmethod
    def _loop(x, tokens_per_expert, w1, w2, w3) -> torch.Tensor:
        outputs = []
        # Every expert takes part, even with zero tokens, so its gradient is zero (not None).
        for expert, tokens in enumerate(x.split(tokens_per_expert.tolist())):
            hidden = F.silu(F.linear(tokens, w1[expert])) * F.linear(tokens, w3[expert])
            outputs.append(F.linear(hidden, w2[expert]))
        return torch.cat(outputs)


class MoE(nn.Module):
    """One MoE feed-forward layer: ``router`` (``TopKRouter``) and ``experts`` (``GroupedExperts``);
    the output of a token is the router-weighted sum of its top-k experts' outputs."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        experts_impl: str = "auto",
    ):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = TopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim, experts_impl)

    def forward(
        self,
        x: torch.Tensor,
        seq_ids: torch.Tensor,
        router_mask: torch.Tensor,
        num_seqs: int,
        replayed: torch.Tensor | None = None,
        replay: bool = True,
    ) -> tuple[torch.Tensor, ...]:
        """``x [T, dim]``; ``seq_ids [T]`` in ``[0, num_seqs)``; ``router_mask [T]`` bool, false on
        padding; ``replayed [T, k]`` (int, optional): experts to use instead of the router's
        top-k, -1 rows where a token routes itself (``TopKRouter.replay``); with ``replay`` false
        they are only compared with the router's choice, which the layer keeps. Returns ``(out [T, dim],
        counts [S, E], prob_sums [S, E], z_sums [S], agreement [2], experts [T, k])``: one
        layer's ``RouterStats`` slice and the experts each token used. Padding tokens are routed
        and computed like any other (their outputs only reach zero-weight losses) but never
        enter the statistics."""
        num_tokens = x.shape[0]
        if x.dim() != 2 or seq_ids.shape != (num_tokens,) or router_mask.shape != (num_tokens,):
            raise ValueError(
                "MoE takes x [T, dim], seq_ids [T] and router_mask [T], got "
                f"{tuple(x.shape)}, {tuple(seq_ids.shape)}, {tuple(router_mask.shape)}"
            )
        if router_mask.dtype != torch.bool:
            raise ValueError(f"router_mask must be bool, got {router_mask.dtype}")
        if replayed is not None and replayed.shape != (num_tokens, self.top_k):
            raise ValueError(
                f"replayed experts must be [T, top_k] = {(num_tokens, self.top_k)}, got {tuple(replayed.shape)}"
            )
        logits = self.router(x)
        probs, top_weights, top_experts = self.router.route(logits)
        if replayed is None:
            agreement = torch.zeros(2, device=x.device)
        else:
            agreement = self.router.agreement(top_experts, replayed, router_mask)
            if replay:
                weights, top_experts = self.router.replay(probs, top_experts, replayed)
                top_weights = weights.to(logits.dtype)

        # Dispatch: the T*k (token, expert) pairs sorted by expert; a stable sort keeps tokens
        # in order within an expert, so the combine adds in a fixed order (on CUDA, whose
        # index_add adds with atomics, only under debug.deterministic).
        flat_experts = top_experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of_pair = order // self.top_k
        # scatter_add rather than bincount: bincount needs the maximum on the host (a sync).
        tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_experts, torch.ones_like(flat_experts)
        )
        expert_out = self.experts(x[token_of_pair], tokens_per_expert)
        expert_out = expert_out * top_weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add(0, token_of_pair, expert_out)
        stats = router_statistics(logits, probs, top_experts, seq_ids, router_mask, num_seqs)
        return (out, *stats, agreement, top_experts)


def router_statistics(
    logits: torch.Tensor,
    probs: torch.Tensor,
    top_experts: torch.Tensor,
    seq_ids: torch.Tensor,
    router_mask: torch.Tensor,
    num_seqs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's ``(counts [S, E], prob_sums [S, E], z_sums [S])`` (see ``RouterStats``) of
    the real tokens (``router_mask``) per sequence."""
    num_experts = probs.shape[-1]
    real = router_mask[:, None]
    # Padding may carry any sequence id; its contributions are zero, so send them to sequence 0.
    seq = torch.where(router_mask, seq_ids, 0)
    with torch.no_grad():
        slots = (seq[:, None] * num_experts + top_experts).reshape(-1)
        hits = real.expand_as(top_experts).reshape(-1).float()
        counts = torch.zeros(num_seqs * num_experts, device=probs.device).index_add_(0, slots, hits)
    # torch.where, not a multiply by the mask: a non-finite value on padding stays out of the
    # sums and of their gradients.
    prob_sums = probs.new_zeros(num_seqs, num_experts).index_add(0, seq, torch.where(real, probs, 0.0))
    z = torch.logsumexp(logits.float(), dim=-1).square()
    z_sums = z.new_zeros(num_seqs).index_add(0, seq, torch.where(router_mask, z, 0.0))
    return counts.view(num_seqs, num_experts), prob_sums, z_sums
