"""Rollout correction: per-token weights for the gap between the policy that sampled the
rollouts (behaviour, ``sampler_logprobs``) and the proximal policy the update starts from
(``prox_logprobs``, recomputed by the trainer).

The two differ because inference and training kernels disagree (a bf16 sampler against an
fp32 trainer, other attention kernels) and, in asynchronous RL, because the sampler's weights
are older. With ``ρ_t = π_prox(y_t) / π_behave(y_t)`` over a sequence's loss tokens, and ``ρ``
either that per token (level "token") or the sequence's product ``Π_t ρ_t`` given to each of
its tokens (level "sequence"), the weight multiplying each token's policy term is

| mode       | weight                                                                    |
|------------|---------------------------------------------------------------------------|
| `none`     | 1 (no correction)                                                         |
| `tis`      | min(ρ, max) (truncated importance sampling)                               |
| `mis`      | ρ where ρ <= max, else 0 (masked importance sampling)                      |
| `icepop`   | ρ where min <= ρ <= max, else 0 (IcePop: both tails masked)                |
| `geo_mask` | 1 where min <= exp(mean_t log ρ_t) <= max over the sequence, else 0        |

A weight of 0 masks the token: it keeps its place in the reduction's counts (the loss's
normalization does not depend on the correction) but contributes no gradient. Weights depend
only on a sample's own log-probs, so they are the same for any parallel layout; the metrics
are sums over every sample of the step (``rl/rollout_corr/*``).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.losses.rollout_weights import MAX_LOG_RATIO, RolloutCorrection, sequence_log_ratio, weights_of

# Sums over the step's samples, reduced over the `batch` mesh (CP / TP peers hold copies).
_SUMS = ("loss_tokens", "weight", "weight_sq", "masked_tokens", "sequences", "masked_sequences", "k1", "k3")


def apply_rollout_correction(
    samples: list[Sample], config: RolloutCorrection, batch_mesh: DeviceMesh | None
) -> dict[str, float]:
    """Set every sample's ``rollout_weights``; return the step's ``rl/rollout_corr/*`` metrics
    (one sum and one max all-reduce over ``batch_mesh``).

    Metrics over loss tokens: the weights' mean and max, the fraction masked (weight 0) and
    of sequences with a masked token, the effective sample size ``(Σw)² / (N Σw²)`` of the
    weights, and KL(π_behave ‖ π_prox) estimated from the sampled tokens, ``k1`` = −log ρ and
    ``k3`` = ρ − 1 − log ρ (per token).
    """
    # All samples at once (a loop per sample costs more than the sums on the host).
    values = torch.zeros(len(_SUMS), dtype=torch.float64)
    maximum = torch.zeros(1, dtype=torch.float64)
    if samples:
        lengths = [len(sample) for sample in samples]
        mask = torch.cat([sample.loss_mask for sample in samples])
        prox = torch.cat([sample.prox_logprobs for sample in samples]).double()
        log_ratio = torch.where(mask, prox - torch.cat([sample.sampler_logprobs for sample in samples]).double(), 0.0)
        seq = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lengths))
        # Per sample: Σ log ρ over its loss tokens, their count.
        per_seq = torch.zeros(2, len(samples), dtype=torch.float64)
        per_seq.index_add_(1, seq, torch.stack((log_ratio, mask.double())))
        token_value = log_ratio
        if config.per_sequence:
            token_value = sequence_log_ratio(config, per_seq[0], per_seq[1])[seq]
        weights = weights_of(config, token_value, mask)
        for sample, sample_weights in zip(samples, weights.split(lengths)):
            sample.rollout_weights = sample_weights.clone()  # not a view: a sample may be pickled alone
        w = weights[mask].double()
        log_ratio = log_ratio[mask].clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        masked = torch.zeros(len(samples), dtype=torch.float64).index_add_(0, seq[mask], (w == 0).double())
        values = torch.stack(
            [
                torch.tensor(float(w.numel()), dtype=torch.float64),
                w.sum(),
                w.square().sum(),
                (w == 0).double().sum(),
                (per_seq[1] > 0).double().sum(),
                (masked > 0).double().sum(),
                (-log_ratio).sum(),
                (torch.expm1(log_ratio) - log_ratio).sum(),
            ]
        )
        if w.numel():
            maximum = w.max().reshape(1)
    if batch_mesh is not None:
        dist.all_reduce(values, group=batch_mesh.get_group())
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=batch_mesh.get_group())
    total = dict(zip(_SUMS, values.tolist()))
    tokens = max(total["loss_tokens"], 1.0)
    return {
        "rl/rollout_corr/weight_mean": total["weight"] / tokens,
        "rl/rollout_corr/weight_max": maximum.item(),
        "rl/rollout_corr/masked_fraction_token": total["masked_tokens"] / tokens,
        "rl/rollout_corr/masked_fraction_seq": total["masked_sequences"] / max(total["sequences"], 1.0),
        "rl/rollout_corr/ess": total["weight"] ** 2 / (tokens * total["weight_sq"]) if total["weight_sq"] else 0.0,
        "rl/rollout_corr/kl_k1": total["k1"] / tokens,
        "rl/rollout_corr/kl_k3": total["k3"] / tokens,
    }
