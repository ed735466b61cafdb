"""GRPO compute balancing over data-parallel ranks (``rl.rollouts.plan_dp_balance`` and the
exchange around it), with the collectives replaced by plain lists: what rank s addresses to
rank d arrives at d as the s-th entry, as ``all_to_all_objects`` delivers it.

Checked: every sample of a mini-batch is trained by exactly one rank, each rank's samples keep
the global (slot, sample) order, a rank receives only the samples it trains from another rank
(no byte of any other), the plan depends on the lengths alone (and, without micro-batch
budgets, is the longest-processing-time split worked out here by hand), balancing lowers the
slowest rank's cost on skewed rollouts (the logged imbalance recomputed here from what each rank
ends up holding), and with balancing off, or already even shares, nothing moves.
"""

import copy

import pytest
import torch

from torchtitan_rl.data.balance import sample_cost
from torchtitan_rl.rl.generator import Rollout
from torchtitan_rl.rl.rollouts import (
    assemble_minibatches,
    balance_over_data_parallel,
    outgoing_samples,
    plan_dp_balance,
    score_groups,
    to_samples,
)
from torchtitan_rl.rl.tasks import Reward

GROUP_SIZE = 3
PROMPT = [1, 2, 3, 4]


def rank_minibatches(completion_lengths: list[list[list[list[int]]]]) -> list[list[list]]:
    """Per rank, per mini-batch, the samples of its prompt share: ``completion_lengths[r][m]``
    lists, per prompt of the share, its samples' completion lengths. Slots are numbered
    globally in (mini-batch, rank, prompt) order, as ``rank_prompt_slots`` does."""
    num_ranks, num_minibatches = len(completion_lengths), len(completion_lengths[0])
    per_share = len(completion_lengths[0][0])
    out = [[None] * num_minibatches for _ in range(num_ranks)]
    for r in range(num_ranks):
        for m in range(num_minibatches):
            rollouts, rewards = [], []
            for p, lengths in enumerate(completion_lengths[r][m]):
                slot = (m * num_ranks + r) * per_share + p
                for s, n in enumerate(lengths):
                    rollouts.append(Rollout(slot, s, PROMPT, [5 + s] * n, [-0.5] * n, "stop"))
                    rewards.append(Reward(float(s % 2), s % 2 == 1, {}))
            groups = score_groups(rollouts, rewards, GROUP_SIZE, "grpo", 1e-6) if rollouts else []
            out[r][m] = to_samples(groups, 512)
    return out


def exchange(per_rank: list[list[list]], balance: bool) -> tuple[list[list[list]], dict, list]:
    """What ``balance_over_data_parallel`` does on every rank, the collectives done by hand.
    Also returns, per rank, what it received from each other rank."""
    lengths = [[[len(s) for s in mb] for mb in minibatches] for minibatches in per_rank]
    plan, stats = plan_dp_balance(lengths, balance)
    outgoing = [outgoing_samples(plan, r, per_rank[r]) for r in range(len(per_rank))]
    received = [[outgoing[s][r] for s in range(len(per_rank))] for r in range(len(per_rank))]
    assigned = [assemble_minibatches(plan, r, per_rank[r], received[r]) for r in range(len(per_rank))]
    return assigned, stats, received


def global_order(per_rank: list[list[list]], m: int) -> list:
    return [s for minibatches in per_rank for s in minibatches[m]]


def slowest_over_mean(assigned: list[list[list]]) -> float:
    """Σ over mini-batches of the slowest rank's cost over Σ of the mean rank cost."""
    slowest = mean = 0.0
    for m in range(len(assigned[0])):
        loads = [sum(sample_cost(len(s)) for s in minibatches[m]) for minibatches in assigned]
        slowest += max(loads)
        mean += sum(loads) / len(loads)
    return slowest / mean


# Rank 0's prompts got long answers, the others' short ones; rank 2's second share lost a
# group to zero-variance filtering, and rank 1 has nothing left in mini-batch 1.
SKEWED = [
    [[[60, 50, 55], [40, 45, 30]], [[70, 20, 65], [35, 50, 60]]],
    [[[3, 4, 2], [5, 1, 2]], []],
    [[[8, 2, 3], [1, 1, 9]], [[4, 6, 2]]],
]


def key(sample) -> tuple:
    """A sample's identity across the exchange (moved samples arrive as new objects): its
    prompt slot and completion, distinct for every rollout of ``rank_minibatches``."""
    fields = sample if isinstance(sample, dict) else vars(sample)
    return fields["group_id"], tuple(fields["labels"].tolist())


@pytest.mark.parametrize("data", [SKEWED, SKEWED[:2], SKEWED[1:]], ids=["dp3", "dp2", "dp2_short_first"])
def test_every_sample_trained_once_in_global_order_and_more_even(data):
    per_rank = rank_minibatches(data)
    assigned, stats, received = exchange(per_rank, balance=True)
    for m in range(len(per_rank[0])):
        whole = global_order(per_rank, m)
        position = {key(s): i for i, s in enumerate(whole)}
        assert len(position) == len(whole)
        got = [s for minibatches in assigned for s in minibatches[m]]
        assert sorted(position[key(s)] for s in got) == list(range(len(whole)))  # each exactly once
        for minibatches in assigned:
            indices = [position[key(s)] for s in minibatches[m]]
            assert indices == sorted(indices)  # the global (slot, sample) order within a rank
        # A moved sample arrives whole: every field, value and dtype.
        for sample in got:
            original = whole[position[key(sample)]]
            for name, value in vars(original).items():
                if isinstance(value, torch.Tensor):
                    assert getattr(sample, name).dtype == value.dtype and torch.equal(getattr(sample, name), value)
                else:
                    assert getattr(sample, name) == value, name
    # A rank receives from rank s exactly the samples of s that it trains: the movers, each
    # to its trainer alone, and no byte of a sample trained elsewhere.
    for r, by_source in enumerate(received):
        trained = {key(s) for minibatches in assigned[r] for s in minibatches}
        for source, samples in enumerate(by_source):
            own = {key(s) for minibatches in per_rank[source] for s in minibatches}
            expected = set() if source == r else own & trained
            assert {key(s) for s in samples} == expected and len(samples) == len(expected), (r, source)
    assert sum(len(samples) for by_source in received for samples in by_source) > 0
    # The logged values are those of the splits really used, recomputed from the ranks' samples.
    assert stats["dp_cost_imbalance"] == pytest.approx(slowest_over_mean(assigned))
    assert stats["dp_cost_imbalance_balanced"] == stats["dp_cost_imbalance"]
    assert stats["dp_cost_imbalance_contiguous"] == pytest.approx(slowest_over_mean(per_rank))
    assert stats["dp_cost_imbalance"] < min(1.1, stats["dp_cost_imbalance_contiguous"] - 0.2), stats


def longest_processing_time(costs: list[float], num_ranks: int) -> list[list[int]]:
    """By hand, the split without micro-batch budgets: costliest sample first (ties: global
    order), each to the bin with the least cost so far (ties: the lower bin); the costliest bin
    to rank 0, the next to rank 1, ... (ties: the bin with the lower first index)."""
    bins, loads = [[] for _ in range(num_ranks)], [0.0] * num_ranks
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        k = min(range(num_ranks), key=lambda k: (loads[k], k))
        bins[k].append(i)
        loads[k] += costs[i]
    return [sorted(bins[k]) for k in sorted(range(num_ranks), key=lambda k: (-loads[k], min(bins[k], default=0)))]


def test_plan_is_the_longest_processing_time_split_of_the_global_order():
    lengths = [[[len(s) for s in mb] for mb in minibatches] for minibatches in rank_minibatches(SKEWED)]
    plan, _ = plan_dp_balance(lengths, True)
    assert plan_dp_balance(copy.deepcopy(lengths), True)[0] == plan  # a function of the lengths alone
    for m, ranks in enumerate(plan):
        keys = [(r, i) for r in range(3) for i in range(len(lengths[r][m]))]  # rank 0's slots first
        costs = [sample_cost(lengths[r][m][i]) for r, i in keys]
        own = [[g for g, (r, _) in enumerate(keys) if r == rank] for rank in range(3)]
        expected = longest_processing_time(costs, 3)
        # One micro-batch per rank: the step costs its slowest rank; the own shares are kept unless slower.
        slowest = [max(sum(costs[i] for i in share) for share in split) for split in (expected, own)]
        assert slowest[0] < slowest[1]
        assert ranks == [[keys[i] for i in indices] for indices in expected]


def test_balancing_off_keeps_every_rank_share_and_logs_its_imbalance():
    per_rank = rank_minibatches(SKEWED)
    assigned, stats, received = exchange(per_rank, balance=False)
    assert received == [[[], [], []]] * 3
    for r in range(3):
        assert [[id(s) for s in mb] for mb in assigned[r]] == [[id(s) for s in mb] for mb in per_rank[r]]
    assert (
        stats["dp_cost_imbalance"]
        == stats["dp_cost_imbalance_contiguous"]
        == pytest.approx(slowest_over_mean(per_rank))
    )
    assert stats["dp_cost_imbalance_balanced"] < stats["dp_cost_imbalance"]


def test_even_shares_stay_put():
    even = [[[[10, 20, 30]], [[5, 5, 5]]], [[[30, 20, 10]], [[5, 5, 5]]]]
    per_rank = rank_minibatches(even)
    assigned, stats, received = exchange(per_rank, balance=True)
    assert received == [[[], []]] * 2
    assert stats == {
        "dp_cost_imbalance": 1.0,
        "dp_cost_imbalance_contiguous": 1.0,
        "dp_cost_imbalance_balanced": 1.0,
    }


def test_one_data_parallel_rank_needs_no_collective():
    minibatches = rank_minibatches([SKEWED[0]])[0]
    kept, stats = balance_over_data_parallel(minibatches, None, True)
    assert kept is minibatches
    assert set(stats.values()) == {1.0}


def test_group_ids_travel_with_their_samples():
    """prompt_mean weighs whole prompt groups; a group split over ranks still names its slot."""
    per_rank = rank_minibatches(SKEWED)
    assigned, _, _ = exchange(per_rank, balance=True)
    for m in range(2):
        want = sorted(s.group_id for s in global_order(per_rank, m))
        assert sorted(s.group_id for minibatches in assigned for s in minibatches[m]) == want
    split_groups = {
        s.group_id for r, minibatches in enumerate(assigned) for s in minibatches[0] if s.group_id // 2 != r
    }
    assert split_groups  # the test exercises samples that left their prompt's rank
