"""Laying out a global batch over data-parallel ranks and micro-batches by estimated compute
(``data.balance``), checked against brute force and independent re-implementations."""

import itertools
import math
import random

import pytest

from torchtitan_rl.data.balance import (
    assign_to_ranks,
    contiguous_split,
    estimated_step_cost,
    imbalance,
    plan_microbatches,
    rank_loads,
    sample_cost,
)

# ---------------------------------------------------------------- references


def brute_force_best_makespan(costs, num_ranks):
    return min(
        max(sum(c for c, r in zip(costs, ranks) if r == rank) for rank in range(num_ranks))
        for ranks in itertools.product(range(num_ranks), repeat=len(costs))
    )


def first_fit_decreasing_count(seq_lens, patches, max_tokens, max_patches):
    """Bins first-fit-decreasing needs, costliest sample first (ties: lower index)."""
    order = sorted(range(len(seq_lens)), key=lambda i: (-sample_cost(seq_lens[i], patches[i]), i))
    bins = []
    for i in order:
        for b in bins:
            if (not max_tokens or b[0] + seq_lens[i] <= max_tokens) and (
                not max_patches or b[1] + patches[i] <= max_patches
            ):
                b[0] += seq_lens[i]
                b[1] += patches[i]
                break
        else:
            bins.append([seq_lens[i], patches[i]])
    return len(bins)


def balanced_microbatch_costs(seq_lens, patches, max_tokens, max_patches):
    """The costs of the balanced micro-batch plan of one rank's samples, costliest first, worked
    out from its rule: as many micro-batches as first-fit-decreasing needs, then the samples
    spread over them costliest first, each to the cheapest one it fits (the first-fit-decreasing
    micro-batches if some sample fits none)."""
    costs = [sample_cost(n, p) for n, p in zip(seq_lens, patches)]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))

    def fits(load, i):
        return (not max_tokens or load[0] + seq_lens[i] <= max_tokens) and (
            not max_patches or load[1] + patches[i] <= max_patches
        )

    def place(num_bins, choose):
        loads, totals = [[0, 0] for _ in range(num_bins)], [0.0] * num_bins
        for i in order:
            k = choose([k for k in range(num_bins) if fits(loads[k], i)], totals)
            if k is None:
                return None
            loads[k][0] += seq_lens[i]
            loads[k][1] += patches[i]
            totals[k] += costs[i]
        return totals

    num_bins = first_fit_decreasing_count(seq_lens, patches, max_tokens, max_patches)
    spread = place(num_bins, lambda fitting, totals: min(fitting, key=lambda k: (totals[k], k)) if fitting else None)
    first_fit = place(num_bins, lambda fitting, totals: fitting[0])
    return sorted(spread if spread is not None else first_fit, reverse=True)


def step_cost(seq_lens, patches, assignment, max_tokens, max_patches):
    """Σ over positions of the costliest rank's micro-batch, each rank planned balanced."""
    per_rank = [
        balanced_microbatch_costs(
            [seq_lens[i] for i in indices], [patches[i] for i in indices], max_tokens, max_patches
        )
        for indices in assignment
    ]
    depth = max(map(len, per_rank))
    return sum(max(costs[k] if k < len(costs) else 0.0 for costs in per_rank) for k in range(depth))


def varied_lengths(rng, count, budget):
    """Lognormal lengths like real SFT rows (median a fifth of the budget), clipped to it."""
    return [min(budget, max(8, round(rng.lognormvariate(math.log(budget / 5), 1.0)))) for _ in range(count)]


# ---------------------------------------------------------------- balanced micro-batch plan


def test_balanced_plan_hand_worked_example():
    # First-fit-decreasing (sizes 5, 4, 3, 2, 1 under 7): [5, 2] [4, 3] [1] -> 3 micro-batches.
    # Spread over 3 instead, each to the cheapest bin it fits: [5] [4, 1] [3, 2], costs 5, 5, 5
    # (the quadratic term orders them), against in-order 3+4 | 2+5 | 1 = 7, 7, 1.
    assert plan_microbatches([3, 4, 2, 5, 1], 7, balanced=True) == [[3], [1, 4], [0, 2]]
    assert plan_microbatches([3, 4, 2, 5, 1], 7) == [[0, 1], [2, 3], [4]]
    assert plan_microbatches([3, 4], 0, balanced=True) == [[0, 1]]  # no budget: one micro-batch
    assert plan_microbatches([], 7, balanced=True) == []
    with pytest.raises(ValueError, match=r"a sample of 9 tokens exceeds training.max_tokens_per_microbatch=7"):
        plan_microbatches([3, 9], 7, balanced=True)


@pytest.mark.parametrize("seed", range(40))
def test_balanced_plan_properties(seed):
    rng = random.Random(seed)
    max_tokens, max_patches = rng.choice([0, rng.randint(20, 60)]), rng.choice([0, rng.randint(16, 48)])
    seq_lens = [rng.randint(1, max_tokens or 60) for _ in range(rng.randint(1, 25))]
    patches = [rng.choice([0, 0, rng.randint(1, max_patches or 48)]) for _ in seq_lens]
    plan = plan_microbatches(seq_lens, max_tokens, patches, max_patches, balanced=True)
    assert plan == plan_microbatches(list(seq_lens), max_tokens, list(patches), max_patches, balanced=True)
    assert sorted(i for group in plan for i in group) == list(range(len(seq_lens)))  # each exactly once
    assert all(group and group == sorted(group) for group in plan)
    for group in plan:
        assert not max_tokens or sum(seq_lens[i] for i in group) <= max_tokens
        assert not max_patches or sum(patches[i] for i in group) <= max_patches
    assert len(plan) == first_fit_decreasing_count(seq_lens, patches, max_tokens, max_patches)
    costs = [sum(sample_cost(seq_lens[i], patches[i]) for i in group) for group in plan]
    assert costs == sorted(costs, reverse=True)  # costliest first: ranks pair like with like


def test_balanced_plan_evens_out_micro_batches_on_varied_lengths():
    rng = random.Random(3)
    spread_in_order = spread_balanced = 0.0
    for _ in range(50):
        seq_lens = varied_lengths(rng, 16, 1024)
        for balanced in (False, True):
            costs = [
                sum(sample_cost(seq_lens[i]) for i in g) for g in plan_microbatches(seq_lens, 1024, balanced=balanced)
            ]
            spread = max(costs) - min(costs)
            if balanced:
                spread_balanced += spread
                assert len(costs) <= len(plan_microbatches(seq_lens, 1024)) + 1
            else:
                spread_in_order += spread
    assert spread_balanced < 0.5 * spread_in_order


# ---------------------------------------------------------------- ranks


@pytest.mark.parametrize("seed", range(30))
def test_assignment_without_budgets_against_brute_force(seed):
    rng = random.Random(seed)
    num_ranks = rng.choice([2, 3])
    seq_lens = [rng.choice([rng.randint(1, 10), rng.randint(50, 200)]) for _ in range(rng.randint(num_ranks, 8))]
    costs = [sample_cost(n) for n in seq_lens]
    assignment = assign_to_ranks(seq_lens, num_ranks)
    assert assignment == assign_to_ranks(list(seq_lens), num_ranks)  # deterministic
    assert sorted(i for share in assignment for i in share) == list(range(len(costs)))  # each sample exactly once
    assert all(share == sorted(share) and share for share in assignment)  # global order, nobody empty
    makespan = max(rank_loads(costs, assignment))
    best = brute_force_best_makespan(costs, num_ranks)
    assert makespan <= (4 / 3 - 1 / (3 * num_ranks)) * best + 1e-9  # Graham's bound for LPT
    assert makespan <= max(rank_loads(costs, contiguous_split(len(costs), num_ranks))) + 1e-9


@pytest.mark.parametrize("seed", range(20))
def test_assignment_with_budgets_never_costs_more_than_the_fallback(seed):
    rng = random.Random(seed)
    num_ranks = rng.choice([2, 3, 4])
    max_tokens, max_patches = rng.choice([64, 100]), rng.choice([0, 40])
    seq_lens = [rng.randint(1, max_tokens) for _ in range(rng.randint(1, 24))]
    patches = [rng.choice([0, rng.randint(1, 40)]) if max_patches else 0 for _ in seq_lens]
    budgets = {"num_patches": patches, "max_tokens": max_tokens, "max_patches": max_patches}
    fallback = [list(range(r, len(seq_lens), num_ranks)) for r in range(num_ranks)]
    for given in (None, fallback):
        assignment = assign_to_ranks(seq_lens, num_ranks, **budgets, fallback=given)
        assert sorted(i for share in assignment for i in share) == list(range(len(seq_lens)))
        assert all(share == sorted(share) for share in assignment)
        if len(seq_lens) >= num_ranks:
            assert all(assignment)
        cost = estimated_step_cost(seq_lens, assignment, **budgets)
        assert cost == pytest.approx(step_cost(seq_lens, patches, assignment, max_tokens, max_patches))
        baseline = given if given is not None else contiguous_split(len(seq_lens), num_ranks)
        assert cost <= estimated_step_cost(seq_lens, baseline, **budgets) + 1e-9


def test_assignment_on_varied_lengths_is_near_the_ideal_step():
    """Lognormal lengths, 2 and 4 ranks: the contiguous split waits at almost every micro-batch
    for a busier rank; the balanced layout comes within 10 % of the mean rank's cost."""
    rng = random.Random(7)
    for num_ranks in (2, 4):
        ratios = {"contiguous": [], "balanced": []}
        for _ in range(20):
            seq_lens = varied_lengths(rng, 16 * num_ranks, 1024)
            ideal = sum(map(sample_cost, seq_lens)) / num_ranks
            for name, split in (
                ("contiguous", contiguous_split(len(seq_lens), num_ranks)),
                ("balanced", assign_to_ranks(seq_lens, num_ranks, max_tokens=1024)),
            ):
                ratios[name].append(step_cost(seq_lens, [0] * len(seq_lens), split, 1024, 0) / ideal)
        mean = {name: sum(r) / len(r) for name, r in ratios.items()}
        assert mean["balanced"] < 1.1 and mean["contiguous"] > mean["balanced"] + 0.1, mean


def test_assignment_on_skewed_batches_beats_the_contiguous_split():
    # Long samples first, as a length-sorted or unlucky shuffle gives: contiguous puts them all on rank 0.
    sizes = [(2000, 0), (1800, 64), (1500, 0), (1200, 256)] + [(300, 0)] * 12
    seq_lens, patches = [n for n, _ in sizes], [p for _, p in sizes]
    costs = [sample_cost(n, p) for n, p in sizes]
    for num_ranks in [2, 4]:
        assignment = assign_to_ranks(seq_lens, num_ranks, num_patches=patches)
        assert imbalance(costs, assignment) < imbalance(costs, contiguous_split(len(costs), num_ranks))
        assert imbalance(costs, assignment) < 1.1
    assert imbalance([1.0, 1.0], [[0], [1]]) == 1.0 and imbalance([3.0, 1.0], [[0], [1]]) == 1.5


def test_cost_model_and_errors():
    assert sample_cost(8192) == 8192 * 2 and sample_cost(10, 4) == 10 + 100 / 8192 + 2
    assert contiguous_split(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        assign_to_ranks([1, -2], 2)
    with pytest.raises(ValueError, match="num_ranks"):
        assign_to_ranks([1], 0)
