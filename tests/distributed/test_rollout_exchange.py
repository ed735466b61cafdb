"""GRPO rollouts under TP / CP: the peers of a data-parallel rank split the generation work and
all end with the same rollouts; data-parallel ranks hold disjoint prompts that together are the
step; and every rollout equals what one process generates (the layout changes nothing). Then
DP compute balancing: each data-parallel rank trains exactly the samples the cost plan gives it,
unchanged by the trip, and its CP / TP peers the same ones. Reward components are
logged as their means over the step, and named differently on two ranks they stop every rank
with the cause. Dynamic sampling: every layout keeps
the same problems with signal, in the same order, as one process drawing the rounds alone, and
each data-parallel rank trains its slots of them."""

import functools

import pytest
import torch

import layout_cases as lc
import rl_cases
from generator_cases import prompts
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.rl.generator import Rollout, TorchGenerator
from torchtitan_rl.rl.rollouts import PromptStream, plan_dp_balance, rank_prompt_slots, score_groups, to_samples


def reference_generator() -> TorchGenerator:
    model = Qwen3Model(lc.model_args(False))
    model.init_weights(lc.SEED)  # what build_model gives every layout (test_layout_invariance checks)
    generator = TorchGenerator(lc.model_args(False), torch.device("cpu"), max_prompts_per_batch=1)
    generator.update_weights(model)
    return generator


def single_process_rollouts() -> dict:
    generator = reference_generator()
    step_prompts = prompts()
    with lc.one_thread():  # the ranks' float kernels: bitwise equality is the claim
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
def test_reward_components_are_their_means_over_the_step_and_must_share_names(layout_results, layout):
    world = layout[0] * layout[1] * layout[2] * layout[3]
    ranks = layout_results[world][rl_cases.layout_key(*layout)]
    step_prompts = prompts()
    reference = single_process_rollouts()
    rewards = [
        rl_cases.component_reward(Rollout(p, s, step_prompts[p], *reference[(p, s)], "stop")) for p, s in reference
    ]
    for rank in ranks:
        for name in ("parity", "first"):
            expected = sum(r.components[name] for r in rewards) / len(rewards)
            assert rank["metrics"][f"rl/reward_{name}"] == pytest.approx(expected, rel=1e-12), name
        assert rank["metrics"]["rl/pass@1"] == pytest.approx(sum(r.correct for r in rewards) / len(rewards))
        if layout[0] * layout[1] > 1:
            assert "the reward components differ between ranks (['first', 'oddness'] vs ['first', 'parity'])" in (
                rank["renamed_error"] or ""
            )
        else:
            assert rank["renamed_error"] is None


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


@functools.cache
def single_process_dynamic_sampling() -> tuple[list[tuple], int]:
    """Brute force of the step: one process generates each round's prompts whole (slot s of round
    r keyed as prompt r·P + s), walks the groups in (round, slot) order and keeps those whose
    rewards differ until it has P. Returns every (problem, completions) with signal found, and
    the rounds drawn."""
    generator = reference_generator()
    pool = rl_cases.dynamic_pool()
    num_prompts = rl_cases.PROMPTS_PER_STEP
    stream = PromptStream(rl_cases.POOL_SIZE, num_prompts, rl_cases.STREAM_SEED)
    found, num_rounds = [], 0
    with lc.one_thread():
        while num_rounds < rl_cases.MAX_SAMPLING_ROUNDS and len(found) < num_prompts:
            problems = stream.next_step()
            keys = [num_rounds * num_prompts + s for s in range(num_prompts)]
            rollouts = generator.generate(
                [pool[p] for p in problems], keys, rl_cases.NUM_SAMPLES, rl_cases.PARAMS, rl_cases.SEED, rl_cases.STEP
            )
            for slot, problem in enumerate(problems):
                group = rollouts[slot * rl_cases.NUM_SAMPLES : (slot + 1) * rl_cases.NUM_SAMPLES]
                if len({rl_cases.signal_reward(r).total for r in group}) > 1:
                    found.append((problem, [r.completion_tokens for r in group]))
            num_rounds += 1
    return found, num_rounds


@pytest.mark.parametrize("layout", rl_cases.DYNAMIC_SAMPLING_LAYOUTS)
def test_dynamic_sampling_keeps_the_same_groups_with_signal_on_every_layout(layout_results, layout):
    found, num_rounds = single_process_dynamic_sampling()
    num_prompts = rl_cases.PROMPTS_PER_STEP
    kept = found[:num_prompts]
    # The case is worth checking: a later round was needed and some groups had no signal.
    assert num_rounds > 1 and len(found) < num_rounds * num_prompts
    world = layout[0] * layout[1] * layout[2] * layout[3]
    ranks = layout_results[world][rl_cases.dynamic_sampling_key(*layout)]
    dp = layout[0] * layout[1]
    trained_by_batch_rank: dict[int, list] = {}
    for rank in ranks:
        assert rank["kept_problems"] == [problem for problem, _ in kept]
        assert (rank["num_rounds"], rank["num_with_signal"]) == (num_rounds, len(found))
        own = rank_prompt_slots(num_prompts, rl_cases.NUM_MINIBATCHES, rank["batch_rank"], dp)
        assert [slot for slot, *_ in rank["trained"]] == [s for mb in own for s in mb if s < len(kept)]
        for slot, problem, completions in rank["trained"]:
            assert (problem, completions) == kept[slot], (rank["batch_rank"], slot)
        # CP / TP peers of a data-parallel rank train the same groups.
        assert trained_by_batch_rank.setdefault(rank["batch_rank"], rank["trained"]) == rank["trained"]
    assert sorted(slot for trained in trained_by_batch_rank.values() for slot, *_ in trained) == list(range(len(kept)))
