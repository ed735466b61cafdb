"""Generalized advantage estimation (GAE, Schulman et al. 2016) for PPO with a learned critic.

Every function works on packed samples: tensors of concatenated sequences, aligned with their
labels (a sample's tokens as ``Sample.labels``), split by ``seq_lengths``. Only loss tokens (the
tokens the policy sampled) take part: the recursion runs over a sequence's loss tokens in order
and skips everything else, so in a multi-turn episode the value at the first sampled token
after a tool observation bootstraps the last sampled token before it, and an observation earns
no discount step of its own. A sequence's last loss token bootstraps from 0: the episode ends
there.

For the loss tokens t_1 < ... < t_K of one sequence, with rewards r and values V:

    δ_k = r_k + γ·V_{k+1} − V_k        (V_{K+1} = 0)
    A_k = δ_k + γ·λ·A_{k+1}            (A_{K+1} = 0)
    R_k = A_k + V_k                    (the value target)

Everything is computed in float64 on the host; positions that are not loss tokens get 0.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.utils import global_moments


def _check(name: str, values: torch.Tensor, num_tokens: int) -> None:
    if values.shape != (num_tokens,):
        raise ValueError(f"{name} must have shape ({num_tokens},) like loss_mask, got {tuple(values.shape)}")


def _check_lengths(loss_mask: torch.Tensor, seq_lengths: list[int]) -> None:
    if loss_mask.dim() != 1:
        raise ValueError(f"loss_mask must be 1-D, got shape {tuple(loss_mask.shape)}")
    if any(n < 0 for n in seq_lengths) or sum(seq_lengths) != loss_mask.numel():
        raise ValueError(f"seq_lengths {seq_lengths} do not split the {loss_mask.numel()} tokens of loss_mask")


def token_rewards(
    loss_mask: torch.Tensor,
    seq_lengths: list[int],
    episode_rewards: list[float],
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Float64 per-token rewards of packed sequences: each sequence's ``episode_rewards`` entry on
    its last loss token, minus ``kl_coef · kl`` on every loss token (the KL penalty in the reward,
    verl's ``use_kl_in_reward``; ``kl`` per token, aligned with ``loss_mask``). A sequence
    without a loss token has no token to carry its reward, which is an error."""
    _check_lengths(loss_mask, seq_lengths)
    if len(episode_rewards) != len(seq_lengths):
        raise ValueError(f"{len(episode_rewards)} episode rewards for {len(seq_lengths)} sequences")
    mask = loss_mask.bool()
    rewards = torch.zeros(mask.numel(), dtype=torch.float64)
    if kl is not None and kl_coef:
        _check("kl", kl, mask.numel())
        rewards -= kl_coef * torch.where(mask, kl.double(), 0.0)
    start = 0
    for i, (length, reward) in enumerate(zip(seq_lengths, episode_rewards)):
        positions = mask[start : start + length].nonzero()
        if positions.numel() == 0:
            raise ValueError(f"sequence {i} has no loss token to carry its reward")
        rewards[start + int(positions[-1])] += reward
        start += length
    return rewards


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_lengths: list[int],
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of packed sequences, float64, 0 off the loss tokens (see the
    module's formulas). ``rewards`` and ``values`` per token, aligned with ``loss_mask``."""
    _check_lengths(loss_mask, seq_lengths)
    _check("rewards", rewards, loss_mask.numel())
    _check("values", values, loss_mask.numel())
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    mask = loss_mask.bool().tolist()
    r = rewards.double().tolist()
    v = values.double().tolist()
    advantages = [0.0] * len(mask)
    # One backward pass over the host lists: a loss token's advantage needs the next one's, a
    # recursion with no vectorized form that stays stable for long sequences.
    end = len(mask)
    for length in reversed(seq_lengths):
        next_value = running = 0.0
        for t in range(end - 1, end - length - 1, -1):
            if mask[t]:
                running = r[t] + gamma * next_value - v[t] + gamma * lam * running
                advantages[t] = running
                next_value = v[t]
        end -= length
    advantages_t = torch.tensor(advantages, dtype=torch.float64)
    returns = torch.where(loss_mask.bool(), advantages_t + values.double(), 0.0)
    return advantages_t, returns


def whiten(
    advantages: torch.Tensor, loss_mask: torch.Tensor, batch_mesh: DeviceMesh | None, eps: float = 1e-8
) -> torch.Tensor:
    """``advantages`` shifted and scaled to mean 0 and variance 1 over the loss tokens of the
    global batch: the statistics are reduced over ``batch_mesh`` (the data-parallel ranks; CP /
    TP peers hold copies and are not summed), so they are the same under every layout. The
    variance is Bessel-corrected and ``eps`` is added under the root (verl's ``masked_whiten``);
    positions that are not loss tokens stay 0, and so does everything when the global batch has
    fewer than 2 loss tokens."""
    _check("advantages", advantages, loss_mask.numel())
    mask = loss_mask.bool()
    count, mean, variance = global_moments(advantages.double()[mask], batch_mesh)
    if count < 2:
        # No spread to scale by (e.g. every rollout of the step masked by rl.mask_truncated):
        # the step trains nothing on its advantages.
        return torch.zeros(advantages.shape, dtype=torch.float64)
    variance *= count / (count - 1)
    return torch.where(mask, (advantages.double() - mean) / (variance + eps) ** 0.5, 0.0)


def set_critic_targets(
    samples: list[Sample],
    values: list[torch.Tensor],
    episode_rewards: list[float],
    gamma: float,
    lam: float,
    batch_mesh: DeviceMesh | None,
    kl: list[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
) -> None:
    """Give each of this rank's ``samples`` its PPO inputs from the critic's per-token ``values``
    (aligned with its labels) and its episode reward: ``advantages`` (GAE, whitened over the
    global batch: collective over ``batch_mesh``), ``returns`` (the value targets) and
    ``old_values`` (``values``, what value clipping holds the new values near). ``kl``: per
    sample and token, the KL estimate the reward is penalized by with ``kl_coef``."""
    if not (len(values) == len(episode_rewards) == len(samples)) or (kl is not None and len(kl) != len(samples)):
        raise ValueError(f"{len(samples)} samples need as many values, rewards and KL estimates")
    lengths = [len(sample) for sample in samples]
    mask = torch.cat([torch.zeros(0, dtype=torch.bool), *(sample.loss_mask for sample in samples)])
    packed_values = torch.cat([torch.zeros(0), *(v.float() for v in values)])
    packed_kl = None if kl is None else torch.cat([torch.zeros(0), *kl])
    rewards = token_rewards(mask, lengths, episode_rewards, packed_kl, kl_coef)
    advantages, returns = gae(rewards, packed_values, mask, lengths, gamma, lam)
    advantages = whiten(advantages, mask, batch_mesh)
    for sample, a, r, v in zip(
        samples, advantages.split(lengths), returns.split(lengths), packed_values.split(lengths)
    ):
        # Copies, not views of the packed buffers: a sample may be pickled alone.
        sample.advantages, sample.returns, sample.old_values = a.float().clone(), r.float().clone(), v.clone()


def target_metrics(samples: list[Sample], batch_mesh: DeviceMesh | None) -> dict[str, float]:
    """``critic/values_mean``, ``critic/returns_mean`` and ``critic/vf_explained_var`` (verl's
    meanings: 1 − Var(R − V) / Var(R), 1 for a perfect critic, 0 for one that knows only the
    mean) over the loss tokens of the global batch's samples with critic targets (collective
    over ``batch_mesh``)."""
    mask = torch.cat([torch.zeros(0, dtype=torch.bool), *(s.loss_mask for s in samples)])
    values = torch.cat([torch.zeros(0), *(s.old_values for s in samples)]).double()[mask]
    returns = torch.cat([torch.zeros(0), *(s.returns for s in samples)]).double()[mask]
    _, values_mean, _ = global_moments(values, batch_mesh)
    _, returns_mean, returns_variance = global_moments(returns, batch_mesh)
    _, _, error_variance = global_moments(returns - values, batch_mesh)
    explained = 1.0 - error_variance / returns_variance if returns_variance > 0 else 0.0
    return {
        "critic/values_mean": values_mean,
        "critic/returns_mean": returns_mean,
        "critic/vf_explained_var": explained,
    }
