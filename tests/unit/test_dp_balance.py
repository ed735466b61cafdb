"""Assigning a global batch's samples to data-parallel ranks by estimated compute cost."""

import itertools
import random

import pytest

from torchtitan_rl.data.balance import assign_to_ranks, contiguous_split, imbalance, rank_loads, sample_cost

# ---------------------------------------------------------------- DP compute balancing


def brute_force_best_makespan(costs, num_ranks):
    return min(
        max(sum(c for c, r in zip(costs, ranks) if r == rank) for rank in range(num_ranks))
        for ranks in itertools.product(range(num_ranks), repeat=len(costs))
    )


@pytest.mark.parametrize("seed", range(30))
def test_assignment_against_brute_force(seed):
    rng = random.Random(seed)
    num_ranks = rng.choice([2, 3])
    costs = [rng.choice([rng.uniform(1, 10), rng.uniform(50, 200)]) for _ in range(rng.randint(num_ranks, 8))]
    assignment = assign_to_ranks(costs, num_ranks)
    assert assignment == assign_to_ranks(list(costs), num_ranks)  # deterministic
    assert sorted(i for share in assignment for i in share) == list(range(len(costs)))  # each sample exactly once
    assert all(share == sorted(share) and share for share in assignment)  # global order, nobody empty
    makespan = max(rank_loads(costs, assignment))
    best = brute_force_best_makespan(costs, num_ranks)
    assert makespan <= (4 / 3 - 1 / (3 * num_ranks)) * best + 1e-9  # Graham's bound for LPT
    assert makespan <= max(rank_loads(costs, contiguous_split(len(costs), num_ranks))) + 1e-9


def test_assignment_on_skewed_batches_beats_the_contiguous_split():
    # Long samples first, as a length-sorted or unlucky shuffle gives: contiguous puts them all on rank 0.
    costs = [sample_cost(n, p) for n, p in [(2000, 0), (1800, 64), (1500, 0), (1200, 256)] + [(300, 0)] * 12]
    for num_ranks in [2, 4]:
        assignment = assign_to_ranks(costs, num_ranks)
        assert imbalance(costs, assignment) < imbalance(costs, contiguous_split(len(costs), num_ranks))
        assert imbalance(costs, assignment) < 1.1
    assert imbalance([1.0, 1.0], [[0], [1]]) == 1.0 and imbalance([3.0, 1.0], [[0], [1]]) == 1.5


def test_cost_model_and_errors():
    assert sample_cost(8192) == 8192 * 2 and sample_cost(10, 4) == 10 + 100 / 8192 + 2
    assert contiguous_split(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="finite"):
        assign_to_ranks([1.0, float("nan")], 2)
    with pytest.raises(ValueError, match="num_ranks"):
        assign_to_ranks([1.0], 0)
