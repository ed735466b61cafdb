"""Lay out a mini-batch over data-parallel ranks and micro-batches by estimated compute.

FSDP synchronizes the data-parallel ranks at every micro-batch (each one all-gathers and
reduce-scatters the same parameters), so a step lasts about the sum, over micro-batch
positions, of the slowest rank's micro-batch at that position, not the slowest rank's total.
An even layout therefore gives every rank the same number of micro-batches of about the same
cost; packing fewer, fuller micro-batches also saves collectives. Two parts here:

- ``plan_microbatches``: one rank's samples into micro-batches under the token and patch
  budgets, either in order or ``balanced`` (the fewest micro-batches first-fit-decreasing
  finds, with the samples spread so that they cost about the same; costliest first).
- ``assign_to_ranks``: a mini-batch's samples to ranks, from the same kind of plan over the
  whole mini-batch, so that each rank's balanced plan has the same number of micro-batches.

Everything is pure Python on identical inputs with ties broken by index, so every rank
computes the same layout without communication. The gradient does not depend on it: losses
are weighted by global counts (docs/design.md, 'Loss weights'), except token_mean_legacy's
per-micro-batch means, which depend on the packing on purpose.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """A sample's estimated compute, ``tokens + tokens**2 / quadratic_tokens + per_patch *
    patches``, in units of one text token through the model's linear layers (the backward pass
    scales every term alike, so only ratios matter).

    A causal sequence of t tokens has about t**2 / 2 (query, key) pairs, so the quadratic
    term equals the linear one at ``quadratic_tokens`` = 2 x (linear FLOPs per token) /
    (attention FLOPs per pair): where attention's share grows with the model's attention width
    against its linear widths. A vision patch goes through the vision encoder once (and its
    merged feature is also a text token, counted in ``tokens``); attention among an image's
    own patches is left out, as a sample's patch count does not say how they split into images.
    """

    quadratic_tokens: float
    per_patch: float = 0.0

    @classmethod
    def from_flops(
        cls, linear_flops_per_token: float, attention_flops_per_pair: float, flops_per_patch: float = 0.0
    ) -> "CostModel":
        """The cost model of a model whose forward pass takes these FLOPs per token through
        its linear layers, per (query, key) pair through attention (all layers), and per vision
        patch (0: a text model)."""
        if min(linear_flops_per_token, attention_flops_per_pair) <= 0 or flops_per_patch < 0:
            raise ValueError(
                f"FLOPs must be positive (per patch: >= 0), got {linear_flops_per_token} per token, "
                f"{attention_flops_per_pair} per pair, {flops_per_patch} per patch"
            )
        return cls(2 * linear_flops_per_token / attention_flops_per_pair, flops_per_patch / linear_flops_per_token)

    def sample_cost(self, num_tokens: int, num_patches: int = 0) -> float:
        return num_tokens + num_tokens * num_tokens / self.quadratic_tokens + self.per_patch * num_patches


# For callers without a model (tests, tools): about Qwen3-0.6B's attention share (its layers
# alone, without the output head) and a Pixtral-sized encoder next to a ~1B language model.
DEFAULT_COST_MODEL = CostModel(quadratic_tokens=8192.0, per_patch=0.5)

_BUDGET_KEYS = (
    ("tokens", "training.max_tokens_per_microbatch"),
    ("vision patches", "training.max_patches_per_microbatch"),
)


def sample_cost(num_tokens: int, num_patches: int = 0, cost_model: CostModel = DEFAULT_COST_MODEL) -> float:
    """Estimated compute of one sample of ``num_tokens`` input tokens and ``num_patches`` vision patches."""
    return cost_model.sample_cost(num_tokens, num_patches)


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


class _Sizes:
    """Samples' (tokens, patches) sizes, costs and a micro-batch's budgets (0: none)."""

    def __init__(
        self,
        seq_lens: list[int],
        num_patches: list[int] | None,
        max_tokens: int,
        max_patches: int,
        cost_model: CostModel = DEFAULT_COST_MODEL,
    ):
        num_patches = num_patches or [0] * len(seq_lens)
        if len(num_patches) != len(seq_lens) or any(n < 0 for n in (*seq_lens, *num_patches)):
            raise ValueError(f"sample sizes must be >= 0, one per sample: {seq_lens}, {num_patches}")
        self.sizes = list(zip(seq_lens, num_patches))
        self.costs = [cost_model.sample_cost(t, p) for t, p in self.sizes]
        self.budgets = (max_tokens, max_patches)

    def fits(self, load: tuple[int, int], i: int) -> bool:
        return all(not budget or used + size <= budget for used, size, budget in zip(load, self.sizes[i], self.budgets))

    def add(self, load: tuple[int, int], i: int) -> tuple[int, int]:
        return (load[0] + self.sizes[i][0], load[1] + self.sizes[i][1])

    def check(self) -> None:
        for i, sizes in enumerate(self.sizes):
            for size, budget, (what, key) in zip(sizes, self.budgets, _BUDGET_KEYS):
                if budget and size > budget:
                    raise ValueError(
                        f"a sample of {size} {what} exceeds {key}={budget} (sample {i} of this rank's "
                        f"{len(self.sizes)}; samples are never split)"
                    )

    def in_order(self) -> list[list[int]]:
        plan: list[list[int]] = []
        load = (0, 0)
        for i in range(len(self.sizes)):
            if not plan or not self.fits(load, i):
                plan.append([])
                load = (0, 0)
            plan[-1].append(i)
            load = self.add(load, i)
        return plan

    def balanced(self, indices: list[int], multiple_of: int = 1) -> list[list[int]]:
        """``indices`` in the fewest bins first-fit-decreasing finds, rounded up to a multiple
        of ``multiple_of``, then spread over that many: costliest sample first, each to the
        cheapest bin it fits (if one fits none, the first-fit-decreasing bins are kept).
        Bins costliest first, indices ascending in each; a sample over a budget gets a bin of
        its own (``check`` refuses it where a plan must be run)."""
        order = sorted(indices, key=lambda i: (-self.costs[i], i))
        packed = self._first_fit(order)
        num_bins = -(-len(packed) // multiple_of) * multiple_of
        bins = self._spread(order, num_bins) or packed + [[] for _ in range(num_bins - len(packed))]
        for group in bins:
            group.sort()
        return sorted(bins, key=lambda group: (-self.cost(group), group[0] if group else math.inf))

    def cost(self, indices: list[int]) -> float:
        return sum(self.costs[i] for i in indices)

    def step_cost(self, assignment: list[list[int]]) -> float:
        plans = [[self.cost(group) for group in self.balanced(indices)] for indices in assignment]
        return sum(max(plan[k] if k < len(plan) else 0.0 for plan in plans) for k in range(max(map(len, plans))))

    def _first_fit(self, order: list[int]) -> list[list[int]]:
        bins: list[list[int]] = []
        loads: list[tuple[int, int]] = []
        for i in order:
            k = next((k for k, load in enumerate(loads) if self.fits(load, i)), len(bins))
            if k == len(bins):
                bins.append([])
                loads.append((0, 0))
            bins[k].append(i)
            loads[k] = self.add(loads[k], i)
        return bins

    def _spread(self, order: list[int], num_bins: int) -> list[list[int]] | None:
        bins: list[list[int]] = [[] for _ in range(num_bins)]
        loads = [(0, 0)] * num_bins
        costs = [0.0] * num_bins
        for i in order:
            fitting = [k for k in range(num_bins) if not bins[k] or self.fits(loads[k], i)]
            if not fitting:
                return None
            k = min(fitting, key=lambda k: (costs[k], k))
            bins[k].append(i)
            loads[k] = self.add(loads[k], i)
            costs[k] += self.costs[i]
        return bins


def plan_microbatches(
    seq_lens: list[int],
    max_tokens: int,
    num_patches: list[int] | None = None,
    max_patches: int = 0,
    balanced: bool = False,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens`` tokens and at most
    ``max_patches`` vision patches (of the samples' images, ``num_patches``).

    In order by default: a micro-batch is closed when the next sample does not fit. With
    ``balanced``, the fewest micro-batches first-fit-decreasing finds, the samples spread over
    them so that their estimated costs are close, costliest micro-batch first (indices
    ascending within one). A budget of 0 means none: with both 0 everything goes into one
    micro-batch. A sample is never split, so one over a budget is an error. Either way the plan
    is a pure function of the sizes (and ``cost_model``, the model's).
    """
    sizes = _Sizes(seq_lens, num_patches, max_tokens, max_patches, cost_model)
    sizes.check()
    return sizes.balanced(list(range(len(seq_lens)))) if balanced else sizes.in_order()


def spread_microbatches(plan: list[list[int]], seq_lens: list[int], count: int) -> list[list[int]]:
    """``plan`` with micro-batches split in two until there are ``count`` of them or each holds
    one sample: the one with the most tokens splits where its samples' tokens are about halved,
    keeping their order. Lets a pipeline, whose stages work on different micro-batches at once,
    start with enough of them."""
    plan = [list(group) for group in plan]
    while len(plan) < count:
        splittable = [k for k, group in enumerate(plan) if len(group) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda k: sum(seq_lens[i] for i in plan[k]))
        group = plan[k]
        total, prefix, cut = sum(seq_lens[i] for i in group), 0, 1
        for j, i in enumerate(group[:-1]):
            prefix += seq_lens[i]
            cut = j + 1
            if 2 * prefix >= total:
                break
        plan[k : k + 1] = [group[:cut], group[cut:]]
    return plan


def estimated_step_cost(
    seq_lens: list[int],
    assignment: list[list[int]],
    *,
    num_patches: list[int] | None = None,
    max_tokens: int = 0,
    max_patches: int = 0,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> float:
    """Σ over micro-batch positions of the costliest rank's micro-batch there, every rank's
    samples planned ``balanced``: the ranks wait for each other at every micro-batch."""
    return _Sizes(seq_lens, num_patches, max_tokens, max_patches, cost_model).step_cost(assignment)


def assign_to_ranks(
    seq_lens: list[int],
    num_ranks: int,
    *,
    num_patches: list[int] | None = None,
    max_tokens: int = 0,
    max_patches: int = 0,
    fallback: list[list[int]] | None = None,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> list[list[int]]:
    """Per rank, the sample indices it gets, ascending; every index exactly once.

    The whole mini-batch is planned as ``plan_microbatches(balanced=True)`` would, into a
    multiple of ``num_ranks`` micro-batches; they are dealt out in rounds of ``num_ranks``,
    costliest first, the round's costliest to the rank with the least cost so far (ties: lower
    rank). Every rank thus gets as many micro-batches' worth of samples, of about the same cost
    position by position. Without budgets that is one bin per rank: greedy
    longest-processing-time (within 4/3 of the best slowest rank, Graham 1969). With at least
    ``num_ranks`` samples of positive cost every rank gets one.

    When ``fallback`` (default: the contiguous split) has an ``estimated_step_cost`` no higher,
    it is returned instead, so balancing never makes a step slower by this cost model.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    fallback = fallback if fallback is not None else contiguous_split(len(seq_lens), num_ranks)
    if num_ranks == 1:
        return fallback
    sizes = _Sizes(seq_lens, num_patches, max_tokens, max_patches, cost_model)
    bins = sizes.balanced(list(range(len(seq_lens))), multiple_of=num_ranks)
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0.0] * num_ranks
    for start in range(0, len(bins), num_ranks):
        for group, rank in zip(bins[start : start + num_ranks], sorted(range(num_ranks), key=lambda r: (loads[r], r))):
            assignment[rank].extend(group)
            loads[rank] += sizes.cost(group)
    for indices in assignment:
        indices.sort()
    if sizes.step_cost(fallback) <= sizes.step_cost(assignment):
        return fallback
    return assignment
