"""Assign the samples of a global mini-batch to data-parallel ranks by estimated compute.

Every rank computes the same assignment from the same costs (pure Python on identical
inputs, ties broken by index), so no communication is needed. The gradient does not depend
on the assignment: losses are weighted by global counts (docs/design.md, 'Loss weights'); only the time the
fastest ranks wait for the slowest one does.
"""

import heapq
import math

# cost = tokens + tokens^2 / COST_QUADRATIC_TOKENS + COST_PER_PATCH * patches, in units of one
# text token through the linear layers (forward + backward alike, so only ratios matter).
# - Attention adds ~4*d_attn FLOPs per (query, key) pair and causal sequences have t^2/2 pairs,
#   against ~2*N_layer_params per token for the linear layers: for Qwen3-0.6B (d_attn 2048,
#   ~15.7M linear params per layer) the quadratic term equals the linear one near 7.7k tokens;
#   for 8B models near 47k. 8192 fits small models, which is where batches are most skewed.
# - A vision patch goes through the vision transformer (Pixtral's ~0.4B parameters) once, and
#   its merged feature is also a text token (counted in `tokens`); next to a ~1B language
#   model a patch costs about half a text token.
COST_QUADRATIC_TOKENS = 8192.0
COST_PER_PATCH = 0.5


def sample_cost(num_tokens: int, num_patches: int = 0) -> float:
    """Estimated compute of one sample of ``num_tokens`` input tokens and ``num_patches`` vision patches."""
    return num_tokens + num_tokens * num_tokens / COST_QUADRATIC_TOKENS + COST_PER_PATCH * num_patches


def contiguous_split(num_samples: int, num_ranks: int) -> list[list[int]]:
    """Rank r gets the r-th contiguous slice (sizes differ by at most one; equal when divisible)."""
    base, extra = divmod(num_samples, num_ranks)
    bounds = [r * base + min(r, extra) for r in range(num_ranks + 1)]
    return [list(range(bounds[r], bounds[r + 1])) for r in range(num_ranks)]


def rank_loads(costs: list[float], assignment: list[list[int]]) -> list[float]:
    return [sum(costs[i] for i in indices) for indices in assignment]


def imbalance(costs: list[float], assignment: list[list[int]]) -> float:
    """The slowest rank's cost over the mean rank cost (1.0 is perfect balance)."""
    loads = rank_loads(costs, assignment)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def assign_to_ranks(costs: list[float], num_ranks: int) -> list[list[int]]:
    """Per rank, the sample indices it gets, ascending; every index exactly once.

    Greedy longest-processing-time: samples in decreasing cost (ties: lower index first) go
    to the currently least-loaded rank (ties: lower rank). Its slowest rank is within 4/3 of
    the best possible (Graham 1969). When the contiguous split is at least as balanced, that
    split is returned instead, so balancing never makes a step slower by this cost model.

    Ranks may get different numbers of samples. With positive costs and at least
    ``num_ranks`` samples every rank gets at least one (the first ``num_ranks`` samples placed
    all land on empty ranks). Within a rank, samples keep their global order.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if not all(math.isfinite(cost) and cost >= 0 for cost in costs):
        raise ValueError(f"sample costs must be finite and >= 0, got {costs}")
    contiguous = contiguous_split(len(costs), num_ranks)
    if num_ranks == 1:
        return contiguous
    heap = [(0.0, rank) for rank in range(num_ranks)]
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        assignment[rank].append(index)
        heapq.heappush(heap, (load + costs[index], rank))
    for indices in assignment:
        indices.sort()
    if max(rank_loads(costs, contiguous)) <= max(rank_loads(costs, assignment)):
        return contiguous
    return assignment
