import itertools
import math
from fractions import Fraction

import pytest
import torch

from torchtitan_rl.rl.advantages import ADVANTAGE_ESTIMATORS, group_advantages, pass_at_k, zero_variance_groups

# Groups, in shuffled order with sparse ids:
#   id 40: rewards 1, 0, 0.5, 0.5  (mean 0.5; squared deviations 0.25 + 0.25 + 0 + 0 → Bessel std sqrt(0.5/3))
#   id 3:  rewards 2, 0           (mean 1;   Bessel std sqrt(2))
#   id 9:  reward 0.7 alone       (singleton: no baseline)
#   id 1000: rewards 0.1, 0.1, 0.1 (zero variance: no signal)
REWARDS = [1.0, 2.0, 0.1, 0.0, 0.7, 0.1, 0.5, 0.0, 0.1, 0.5]
GROUP_IDS = [40, 3, 1000, 40, 9, 1000, 40, 3, 1000, 40]


def expected(estimator: str, eps: float = 1e-6) -> list[float]:
    std40, std3 = math.sqrt(0.5 / 3), math.sqrt(2.0)
    by_estimator = {
        "grpo": {40: lambda r: (r - 0.5) / (std40 + eps), 3: lambda r: (r - 1.0) / (std3 + eps)},
        "dr_grpo": {40: lambda r: r - 0.5, 3: lambda r: r - 1.0},
        # Mean of the others: (sum - r) / (n - 1), with sums 2.0 (id 40) and 2.0 (id 3).
        "rloo": {40: lambda r: r - (2.0 - r) / 3, 3: lambda r: r - (2.0 - r) / 1},
    }[estimator]
    return [by_estimator[g](r) if g in by_estimator else 0.0 for r, g in zip(REWARDS, GROUP_IDS)]


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_estimators_match_hand_computation(estimator):
    advantages = group_advantages(torch.tensor(REWARDS), torch.tensor(GROUP_IDS), estimator)
    assert advantages.dtype == torch.float32
    assert advantages.tolist() == pytest.approx(expected(estimator), abs=1e-6)


def test_hand_values_spelled_out():
    # The same numbers as expected(), written out for the group 3 pair (rewards 2 and 0).
    rewards, ids = torch.tensor([2.0, 0.0]), torch.tensor([3, 3])
    assert group_advantages(rewards, ids, "dr_grpo").tolist() == [1.0, -1.0]
    assert group_advantages(rewards, ids, "rloo").tolist() == [2.0, -2.0]
    std = math.sqrt(2.0)
    assert group_advantages(rewards, ids, "grpo").tolist() == pytest.approx([1 / std, -1 / std], abs=1e-6)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_singleton_and_zero_variance_groups_get_exactly_zero(estimator):
    # 0.1 * 3 is not exactly 0.3 in floating point: the mean is off by one ulp, the advantage must not be.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.3], dtype=torch.float64)
    advantages = group_advantages(rewards, torch.tensor([5, 5, 5, 6, 7]), estimator)
    assert advantages.tolist() == [0.0] * 5


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_advantages_follow_their_samples_under_permutation(estimator):
    rewards, ids = torch.tensor(REWARDS), torch.tensor(GROUP_IDS)
    permutation = torch.randperm(len(REWARDS), generator=torch.Generator().manual_seed(0))
    base = group_advantages(rewards, ids, estimator)
    relabeled = group_advantages(rewards[permutation], ids[permutation] * 7 + 1, estimator)
    torch.testing.assert_close(relabeled, base[permutation])


def test_zero_variance_groups():
    mask = zero_variance_groups(torch.tensor(REWARDS), torch.tensor(GROUP_IDS))
    assert mask.tolist() == [g in (9, 1000) for g in GROUP_IDS]


def test_empty_batch():
    empty = group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), "grpo")
    assert empty.shape == (0,) and empty.dtype == torch.float32


@pytest.mark.parametrize(
    "rewards, group_ids, estimator, match",
    [
        (torch.zeros(2), torch.zeros(2, dtype=torch.long), "ppo", r"unknown advantage estimator 'ppo'.*'grpo'"),
        (torch.zeros(2), torch.zeros(3, dtype=torch.long), "grpo", "one length"),
        (torch.zeros(2), torch.zeros(2), "grpo", "integers"),
        (torch.zeros(2), torch.tensor([0, -1]), "grpo", "non-negative"),
        (torch.tensor([0.0, math.nan]), torch.zeros(2, dtype=torch.long), "grpo", "finite"),
    ],
)
def test_invalid_inputs(rewards, group_ids, estimator, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_ids, estimator)


def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """The fraction of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in subset) for subset in subsets), len(subsets))


@pytest.mark.parametrize(
    "n, c, k",
    [(1, 0, 1), (1, 1, 1), (5, 0, 3), (5, 1, 1), (5, 2, 3), (6, 3, 4)]
    + [(8, 1, 8), (8, 5, 4), (10, 3, 2), (10, 9, 5), (12, 4, 6)],
)
def test_pass_at_k_matches_brute_force(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(n, c, k)), abs=1e-12)


def test_pass_at_k_is_stable_for_many_samples():
    # C(1000, 500) overflows a float; the product form does not. Exact value via integer binomials.
    exact = 1 - Fraction(math.comb(1000 - 3, 500), math.comb(1000, 500))
    assert pass_at_k(1000, 3, 500) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 1, 5), (4, 1, 0), (4, 5, 2), (4, -1, 2)])
def test_pass_at_k_rejects_inconsistent_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)
