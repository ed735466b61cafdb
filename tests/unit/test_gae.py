"""GAE, its per-token rewards and the whitening of advantages, against brute-force references:
the advantage as the explicit discounted sum of TD errors over each sequence's loss tokens
(not the recursion the code runs), Monte Carlo returns at γ = λ = 1, one-step TD errors at
λ = 0, and the batch's mean and unbiased standard deviation from torch."""

import random

import pytest
import torch

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.utils import global_moments
from torchtitan_rl.rl.gae import gae, set_critic_targets, target_metrics, token_rewards, whiten


def packed_episodes(seed: int) -> tuple[torch.Tensor, list[int]]:
    """A loss mask of several packed multi-turn sequences: a prompt, then sampled turns
    separated by observation spans, one sequence without any loss token."""
    rng = random.Random(seed)
    masks, lengths = [], []
    for i in range(5):
        mask = [False] * rng.randint(1, 4)  # the prompt
        if i != 2:  # sequence 2 has no sampled token
            for _ in range(rng.randint(1, 3)):
                mask += [True] * rng.randint(1, 5) + [False] * rng.randint(0, 3)
        masks += mask
        lengths.append(len(mask))
    return torch.tensor(masks), lengths


def brute_force(rewards, values, mask, lengths, gamma, lam):
    """A_k = Σ_{j>=k} (γλ)^(j-k) δ_j over each sequence's loss tokens, δ_j from the next loss
    token's value (0 after the last), all in Python floats."""
    advantages = [0.0] * len(mask)
    start = 0
    for length in lengths:
        positions = [t for t in range(start, start + length) if mask[t]]
        v = [float(values[t]) for t in positions] + [0.0]
        deltas = [float(rewards[t]) + gamma * v[k + 1] - v[k] for k, t in enumerate(positions)]
        for k, t in enumerate(positions):
            advantages[t] = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, len(positions)))
        start += length
    return torch.tensor(advantages, dtype=torch.float64)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0), (0.0, 0.5), (0.5, 1.0)])
def test_gae_equals_the_discounted_sum_of_td_errors_over_loss_tokens(gamma, lam):
    mask, lengths = packed_episodes(0)
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(mask.numel(), generator=gen, dtype=torch.float64) * mask
    values = torch.randn(mask.numel(), generator=gen, dtype=torch.float64)
    advantages, returns = gae(rewards, values, mask, lengths, gamma, lam)
    want = brute_force(rewards, values, mask.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(advantages, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, torch.where(mask, want + values, 0.0), rtol=1e-12, atol=1e-12)
    assert bool((advantages[~mask] == 0).all()) and bool((returns[~mask] == 0).all())
    assert advantages[mask].abs().min() > 0  # not vacuous


def test_gae_edge_cases_are_monte_carlo_and_td_errors():
    mask, lengths = packed_episodes(3)
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randn(mask.numel(), generator=gen, dtype=torch.float64) * mask
    values = torch.randn(mask.numel(), generator=gen, dtype=torch.float64)
    # γ = λ = 1: the return is the sum of the rewards still to come in the sequence.
    _, returns = gae(rewards, values, mask, lengths, 1.0, 1.0)
    start = 0
    for length in lengths:
        for t in range(start, start + length):
            if mask[t]:
                assert returns[t].item() == pytest.approx(float(rewards[t : start + length].sum()), abs=1e-12)
        start += length
    # λ = 0: the one-step TD error, whose next value is the next *loss* token's (across observations).
    advantages, _ = gae(rewards, values, mask, lengths, 0.9, 0.0)
    start = 0
    for length in lengths:
        positions = [t for t in range(start, start + length) if mask[t]]
        for k, t in enumerate(positions):
            following = float(values[positions[k + 1]]) if k + 1 < len(positions) else 0.0
            assert advantages[t].item() == pytest.approx(float(rewards[t]) + 0.9 * following - float(values[t]))
        start += length


def test_token_rewards_put_the_episode_reward_on_the_last_sampled_token_minus_kl():
    mask = torch.tensor([False, True, True, False, True, False, False, True, True])
    lengths = [6, 3]
    kl = torch.arange(9, dtype=torch.float64) / 10
    got = token_rewards(mask, lengths, [2.0, -1.0], kl, kl_coef=0.5)
    want = torch.tensor([0, -0.05, -0.1, 0, 2 - 0.2, 0, 0, -0.35, -1 - 0.4], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(token_rewards(mask, lengths, [2.0, -1.0]), want + 0.5 * kl * mask)


def test_bad_inputs_are_named_errors():
    mask = torch.tensor([False, True, False, False])
    with pytest.raises(ValueError, match="sequence 1 has no loss token"):
        token_rewards(mask, [2, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="do not split"):
        gae(torch.zeros(4), torch.zeros(4), mask, [3], 1.0, 1.0)
    with pytest.raises(ValueError, match="values must have shape"):
        gae(torch.zeros(4), torch.zeros(3), mask, [4], 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma and lam"):
        gae(torch.zeros(4), torch.zeros(4), mask, [4], 1.5, 1.0)
    # Fewer than 2 loss tokens in the batch: no spread to whiten by, so no advantage.
    assert not whiten(torch.ones(4), mask, None).any()
    assert not whiten(torch.ones(4), torch.zeros(4, dtype=torch.bool), None).any()


def test_whiten_uses_the_batch_mean_and_unbiased_std_of_loss_tokens():
    mask, _ = packed_episodes(5)
    advantages = torch.where(mask, torch.randn(mask.numel(), dtype=torch.float64) * 3 + 7, 0.0)
    got = whiten(advantages, mask, None)
    tokens = advantages[mask]
    torch.testing.assert_close(got[mask], (tokens - tokens.mean()) / (tokens.var(unbiased=True) + 1e-8).sqrt())
    assert bool((got[~mask] == 0).all())


def test_global_moments_keep_a_small_spread_far_from_zero():
    values = 1e8 + torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    count, mean, variance = global_moments(values, None)
    assert (count, mean, variance) == (4, 1e8 + 1.5, 1.25)
    assert global_moments(torch.zeros(0), None) == (0, 0.0, 0.0)


def test_critic_targets_are_gae_whitened_over_the_batch_with_the_values_kept():
    mask, lengths = packed_episodes(7)
    keep = [i for i, n in enumerate(lengths) if mask[sum(lengths[:i]) : sum(lengths[: i + 1])].any()]
    samples, values, rewards, kl = [], [], [], []
    gen = torch.Generator().manual_seed(8)
    start = 0
    for i, n in enumerate(lengths):
        if i in keep:
            sample_mask = mask[start : start + n]
            samples.append(Sample(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), sample_mask))
            values.append(torch.randn(n, generator=gen))
            rewards.append(float(torch.randn(1, generator=gen)))
            kl.append(torch.rand(n, generator=gen))
        start += n
    set_critic_targets(samples, values, rewards, 0.9, 0.8, None, kl, kl_coef=0.1)
    raw = []
    for sample, v, reward, k in zip(samples, values, rewards, kl):
        m = sample.loss_mask
        r = token_rewards(m, [len(m)], [reward], k.double(), 0.1)
        raw.append(brute_force(r, v.double(), m.tolist(), [len(m)], 0.9, 0.8))
        returns = torch.where(m, raw[-1] + v.double(), 0.0).float()
        torch.testing.assert_close(sample.returns, returns)
        torch.testing.assert_close(sample.old_values, v)
    values_t = torch.cat([v[s.loss_mask] for v, s in zip(values, samples)]).double()
    returns_t = torch.cat([s.returns[s.loss_mask] for s in samples]).double()
    metrics = target_metrics(samples, None)
    assert metrics["critic/values_mean"] == pytest.approx(float(values_t.mean()))
    assert metrics["critic/returns_mean"] == pytest.approx(float(returns_t.mean()))
    explained = 1 - float((returns_t - values_t).var()) / float(returns_t.var())
    assert metrics["critic/vf_explained_var"] == pytest.approx(explained)
    tokens = torch.cat([a[s.loss_mask] for a, s in zip(raw, samples)])
    mean, std = tokens.mean(), (tokens.var(unbiased=True) + 1e-8).sqrt()
    for a, sample in zip(raw, samples):
        torch.testing.assert_close(sample.advantages, torch.where(sample.loss_mask, (a - mean) / std, 0.0).float())
