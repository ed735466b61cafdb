"""From rollouts to samples: the prompt stream, which rank trains which prompt, the peers'
split, token alignment of the RL inputs, and the rollout metrics against hand computation."""

import math

import pytest
import torch

from torchtitan_rl.recipes.grpo import combine_updates
from torchtitan_rl.rl.generator import Rollout
from torchtitan_rl.rl.rollouts import (
    PromptStream,
    is_zero_variance,
    rank_prompt_slots,
    rollout_metrics,
    rollout_sums,
    score_groups,
    split_among_peers,
    to_samples,
)
from torchtitan_rl.rl.tasks import Reward


def test_prompt_stream_visits_every_prompt_once_per_epoch_and_resumes_exactly():
    stream = PromptStream(num_problems=10, prompts_per_step=4, seed=3)
    steps = [stream.next_step() for _ in range(5)]  # 20 prompts: two epochs
    flat = [i for s in steps for i in s]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a fresh order every epoch
    again = PromptStream(10, 4, 3)
    assert [again.next_step() for _ in range(2)] == steps[:2]  # deterministic in the seed
    resumed_from = PromptStream(10, 4, 3)
    for _ in range(3):
        resumed_from.next_step()
    resumed = PromptStream(10, 4, 3)
    resumed.load_state_dict(resumed_from.state_dict())
    assert [resumed.next_step() for _ in range(2)] == steps[3:]


@pytest.mark.parametrize("num_minibatches", [1, 2, 4])
def test_minibatches_hold_the_same_prompts_for_every_data_parallel_degree(num_minibatches):
    num_prompts = 16
    for dp in (1, 2, 4):
        per_rank = [rank_prompt_slots(num_prompts, num_minibatches, r, dp) for r in range(dp)]
        for m in range(num_minibatches):
            union = [s for r in range(dp) for s in per_rank[r][m]]
            size = num_prompts // num_minibatches
            assert union == list(range(m * size, (m + 1) * size)), (dp, m)


@pytest.mark.parametrize("num_items, num_peers", [(8, 2), (7, 3), (2, 4), (0, 2)])
def test_peers_split_contiguously_and_cover_everything(num_items, num_peers):
    items = list(range(num_items))
    parts = [split_among_peers(items, p, num_peers) for p in range(num_peers)]
    assert [i for part in parts for i in part] == items
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def rollout(slot, sample, prompt, completion, stop=True):
    return Rollout(
        slot, sample, prompt, completion, [-0.1 * (j + 1) for j in range(len(completion))], "stop" if stop else "length"
    )


def test_samples_align_advantages_and_sampler_logprobs_with_the_completion_labels():
    group = score_groups(
        [rollout(5, 0, [1, 2, 3], [7, 8, 9]), rollout(5, 1, [1, 2, 3], [6], stop=False)],
        [Reward(1.0, True, {}), Reward(0.0, False, {})],
        group_size=2,
        estimator="dr_grpo",
        eps=1e-6,
    )
    first, second = to_samples(group, max_len=10)
    # Tokens 1 2 3 7 8 9: inputs drop the last, labels drop the first.
    assert first.input_ids.tolist() == [1, 2, 3, 7, 8] and first.labels.tolist() == [2, 3, 7, 8, 9]
    # Label positions 2..4 are the completion (7, 8, 9 with its stop token).
    assert first.loss_mask.tolist() == [False, False, True, True, True]
    assert first.advantages.tolist() == [0.0, 0.0, 0.5, 0.5, 0.5]  # dr_grpo: 1 - mean(1, 0)
    assert first.sampler_logprobs.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2, -0.3])
    assert second.loss_mask.tolist() == [False, False, True] and second.advantages.tolist() == [0.0, 0.0, -0.5]
    assert first.group_id == second.group_id == 5
    with pytest.raises(ValueError, match="a rollout of 5 tokens exceeds training.seq_len=4"):
        to_samples(group, max_len=4)


def test_rollout_metrics_by_hand():
    rollouts = [
        rollout(0, 0, [1], [4, 5]),
        rollout(0, 1, [1], [4], stop=False),
        rollout(1, 0, [2], [4, 5, 6]),
        rollout(1, 1, [2], [4]),
    ]
    rewards = [
        Reward(1.0, True, {"format": 1.0}),
        Reward(0.5, False, {"format": 0.0}),
        Reward(0.0, False, {"format": 1.0}),
        Reward(0.0, False, {"format": 1.0}),
    ]
    groups = score_groups(rollouts, rewards, 2, "grpo", 1e-6)
    assert [g.slot for g in groups] == [0, 1]
    assert not is_zero_variance(groups[0]) and is_zero_variance(groups[1])
    assert groups[1].advantages == [0.0, 0.0]
    std = math.sqrt(((1.0 - 0.75) ** 2 + (0.5 - 0.75) ** 2) / 1)  # Bessel: n - 1 = 1
    assert groups[0].advantages == pytest.approx([0.25 / (std + 1e-6), -0.25 / (std + 1e-6)])
    got = rollout_metrics(*rollout_sums(groups, filtered=1), batch_mesh=None)
    totals = [1.0, 0.5, 0.0, 0.0]
    mean = sum(totals) / 4
    assert got == pytest.approx(
        {
            "rl/reward_mean": mean,
            "rl/reward_std": math.sqrt(sum((t - mean) ** 2 for t in totals) / 4),
            "rl/pass@1": 0.25,
            "rl/response_length_mean": (2 + 1 + 3 + 1) / 4,
            "rl/response_length_max": 3.0,
            "rl/truncated": 0.25,
            "rl/groups_all_correct": 0.0,
            "rl/groups_all_wrong": 0.5,
            "rl/groups_mixed": 0.5,
            "rl/filtered_groups": 1.0,
            "rl/num_rollouts": 4.0,
            "rl/reward_format": 0.75,
        }
    )


def test_step_valuescombine_updates():
    updates = [
        {
            "loss_metrics/global_avg_loss": 1.0,
            "loss_metrics/global_max_loss": 3.0,
            "tokens/total": 10.0,
            "grad_norm": 2.0,
        },
        {
            "loss_metrics/global_avg_loss": 3.0,
            "loss_metrics/global_max_loss": 2.0,
            "tokens/total": 12.0,
            "grad_norm": 4.0,
        },
    ]
    assert combine_updates(updates) == {
        "loss_metrics/global_avg_loss": 2.0,
        "loss_metrics/global_max_loss": 3.0,
        "tokens/total": 22.0,
        "grad_norm": 3.0,
    }
    assert combine_updates([]) == {}


def test_advantage_tensor_dtype_is_float():
    group = score_groups(
        [rollout(0, 0, [1], [2]), rollout(0, 1, [1], [3])],
        [Reward(1.0, True, {}), Reward(0.0, False, {})],
        2,
        "rloo",
        1e-6,
    )
    sample = to_samples(group, 8)[0]
    assert sample.advantages.dtype == torch.float32 and sample.sampler_logprobs.dtype == torch.float32
