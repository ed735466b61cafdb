"""What the GRPO recipe's step metrics measure, against sums done by hand: the sampler/trainer
mismatch apart from staleness, and the generation throughput per generating rank."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import torchtitan_rl.recipes.grpo as grpo
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.recipes.grpo import GRPORecipe
from torchtitan_rl.rl.proximal import set_proximal_logprobs


def recipe_without_model(**fields) -> GRPORecipe:
    recipe = GRPORecipe.__new__(GRPORecipe)
    recipe.parallel_dims = SimpleNamespace(mesh=lambda name: None)
    for name, value in fields.items():
        setattr(recipe, name, value)
    return recipe


def rl_sample(sampler_logprobs: list[float], loss_mask: list[bool], version: int) -> Sample:
    n = len(sampler_logprobs)
    return Sample(
        input_ids=torch.arange(n),
        labels=torch.arange(1, n + 1),
        loss_mask=torch.tensor(loss_mask),
        sampler_logprobs=torch.tensor(sampler_logprobs),
        sampler_version=version,
    )


def test_the_sampler_mismatch_is_measured_on_rollouts_of_the_same_weights_only():
    step = 5  # the update starts from the weights after step 4
    samples = [
        rl_sample([0.0, -1.0, -2.0], [False, True, True], version=4),
        rl_sample([0.0, -0.5], [False, True], version=2),  # two updates old
        rl_sample([-3.0, -1.5, -0.25], [True, False, True], version=4),
    ]
    proximal = [
        torch.tensor([-9.0, -1.25, -1.5]),  # |delta| 0.25, 0.5 on the loss tokens
        torch.tensor([-9.0, -2.5]),  # 2.0
        torch.tensor([-3.125, -9.0, -0.25]),  # 0.125, 0.0
    ]
    values = set_proximal_logprobs(samples, proximal, step, None)
    assert values == {
        "rl/sampler_logprob_diff_mean": pytest.approx((0.25 + 0.5 + 0.125 + 0.0) / 4),
        "rl/sampler_logprob_diff_max": pytest.approx(0.5),
        "rl/stale_logprob_diff_mean": pytest.approx(2.0),
        "rl/stale_logprob_diff_max": pytest.approx(2.0),
    }
    assert samples[1].prox_logprobs.tolist() == [0.0, -2.5]  # the proximal policy's, on loss tokens
    # A step whose rollouts all lag (rollout ranks ahead by K) has no mismatch to report.
    stale_only = set_proximal_logprobs(samples, proximal, step + 1, None)
    assert set(stale_only) == {"rl/stale_logprob_diff_mean", "rl/stale_logprob_diff_max"}
    assert stale_only["rl/stale_logprob_diff_mean"] == pytest.approx((0.25 + 0.5 + 2.0 + 0.125 + 0.0) / 5)


class TwoRanks:
    """``dist`` for one rank of two, the other having generated ``peer`` (tokens, seconds)."""

    ReduceOp = dist.ReduceOp

    def __init__(self, peer: tuple[float, float]):
        self.peer = list(peer)

    def is_initialized(self) -> bool:
        return True

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None):
        other = self.peer.pop(0)
        tensor.copy_(
            tensor + other if op == dist.ReduceOp.SUM else torch.maximum(tensor, torch.full_like(tensor, other))
        )


def test_generate_tps_is_tokens_per_second_per_generating_rank(monkeypatch):
    # Colocated on 2 training ranks: this one generated 300 tokens in 2 s, its peer 500 in 4 s.
    colocated = recipe_without_model(
        rollout_client=None, parallel_dims=SimpleNamespace(world_size=2, trainer_group=lambda: None)
    )
    monkeypatch.setattr(grpo, "dist", TwoRanks(peer=(500.0, 4.0)))
    assert colocated._generate_tps(300, 2.0) == pytest.approx((300 + 500) / 2 / 4.0)
    # With 3 rollout ranks the step batch carries their total tokens and their slowest seconds.
    rollout_ranks = recipe_without_model(rollout_client=object(), parallel_dims=SimpleNamespace(num_rollout_ranks=3))
    assert rollout_ranks._generate_tps(900, 4.0) == pytest.approx(900 / 3 / 4.0)
