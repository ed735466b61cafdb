"""GRPO rollouts under TP / CP: the peers of a data-parallel rank split the generation work and
all end with the same rollouts; data-parallel ranks hold disjoint prompts that together are the
step; and every rollout equals what one process generates (the layout changes nothing). Then
DP compute balancing: each data-parallel rank trains exactly the samples the cost plan gives it,
unchanged by the trip, and its CP / TP peers the same ones."""

import pytest
import torch

import layout_cases as lc
import rl_cases
from generator_cases import prompts
from reference import one_thread
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.rl.generator import Rollout, TorchGenerator
from torchtitan_rl.rl.rollouts import plan_dp_balance, rank_prompt_slots, score_groups, to_samples


def single_process_rollouts() -> dict:
    model = Qwen3Model(lc.model_args(False))
    model.init_weights(lc.SEED)  # what build_model gives every layout (test_layout_invariance checks)
    generator = TorchGenerator(lc.model_args(False), torch.device("cpu"), max_prompts_per_batch=1)
    generator.update_weights(model)
    step_prompts = prompts()
    with one_thread():  # the ranks' float kernels: bitwise equality is the claim
        rollouts = generator.generate(
            step_prompts,
            list(range(len(step_prompts))),
            rl_cases.NUM_SAMPLES,
            rl_cases.PARAMS,
            rl_cases.SEED,
            rl_cases.STEP,
        )
    return {(p, s): (tokens, logprobs) for p, s, tokens, logprobs in rl_cases.summary(rollouts)}


@pytest.mark.parametrize("layout", rl_cases.EXCHANGE_LAYOUTS)
def test_peers_share_identical_rollouts_and_data_parallel_ranks_disjoint_ones(layout_results, layout):
    world = layout[0] * layout[1] * layout[2] * layout[3]
    ranks = layout_results[world][rl_cases.layout_key(*layout)]
    reference = single_process_rollouts()
    by_batch_rank: dict[int, list[dict]] = {}
    for rank in ranks:
        by_batch_rank.setdefault(rank["batch_rank"], []).append(rank)
    assert len(by_batch_rank) == layout[0] * layout[1]
    seen = []
    for batch_rank, peers in by_batch_rank.items():
        assert len(peers) == layout[2] * layout[3]
        whole = peers[0]["all"]
        # Every peer ends with the same rollouts: its rank's slots x samples, in slot order ...
        assert all(p["all"] == whole for p in peers)
        assert [(p, s) for p, s, *_ in whole] == [
            (slot, s) for slot in peers[0]["slots"] for s in range(rl_cases.NUM_SAMPLES)
        ]
        # ... of which it generated its own, non-empty, disjoint part.
        parts = [p["local"] for p in peers]
        assert all(parts) and [r for part in parts for r in part] == whole
        seen += [(p, s) for p, s, *_ in whole]
        for p, s, tokens, logprobs in whole:
            assert (tokens, logprobs) == reference[(p, s)], (batch_rank, p, s)
    assert sorted(seen) == sorted(reference)  # data-parallel ranks: disjoint, the whole step


@pytest.mark.parametrize("layout", rl_cases.EXCHANGE_LAYOUTS)
def test_data_parallel_ranks_train_the_balanced_split_of_each_minibatch(layout_results, layout):
    world = layout[0] * layout[1] * layout[2] * layout[3]
    ranks = layout_results[world][rl_cases.layout_key(*layout)]
    dp = layout[0] * layout[1]
    step_prompts = prompts()
    reference = single_process_rollouts()
    # The samples one process builds from the same rollouts, per mini-batch in (slot, sample) order.
    rollouts = [
        Rollout(p, s, step_prompts[p], *reference[(p, s)], "stop")
        for p in range(len(step_prompts))
        for s in range(rl_cases.NUM_SAMPLES)
    ]
    groups = score_groups(rollouts, [rl_cases.reward(r) for r in rollouts], rl_cases.NUM_SAMPLES, "grpo", 1e-6)
    per_minibatch = len(step_prompts) // rl_cases.NUM_MINIBATCHES
    whole = [
        [rl_cases.sample_summary(x) for x in to_samples(groups[m * per_minibatch : (m + 1) * per_minibatch], 64)]
        for m in range(rl_cases.NUM_MINIBATCHES)
    ]
    # Each DP rank's own samples (its prompt share), then the plan every rank should have derived.
    own = [
        [
            [x for x in whole[m] if x[0] in slots]
            for m, slots in enumerate(rank_prompt_slots(len(step_prompts), rl_cases.NUM_MINIBATCHES, r, dp))
        ]
        for r in range(dp)
    ]
    plan, imbalance = plan_dp_balance([[[len(x[1]) for x in mb] for mb in minibatches] for minibatches in own], True)
    moved = 0
    for rank in ranks:
        r = rank["batch_rank"]
        assert rank["imbalance"] == imbalance
        for m in range(rl_cases.NUM_MINIBATCHES):
            want = [own[source][m][i] for source, i in plan[m][r]]
            assert rank["balanced"][m] == want, (r, m)
            moved += sum(source != r for source, _ in plan[m][r])
    if dp > 1:
        assert moved > 0  # samples really changed rank, through the real collectives
        assert imbalance["dp_cost_imbalance"] < imbalance["dp_cost_imbalance_contiguous"]
