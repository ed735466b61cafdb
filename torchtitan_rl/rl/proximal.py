"""The proximal policy of an RL update (decoupled PPO): where its log-probs come from, and what
they say about the sampler (docs/design.md, 'The RL step')."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.losses.rollout_weights import RolloutCorrection
from torchtitan_rl.rl.rollout_ranks import staleness


def proximal_source(rl, correction: RolloutCorrection) -> str:
    """Where the ratio's old policy comes from (``rl.proximal``): "sampler" (no correction and
    one optimizer step on fresh rollouts: the ratio is to the policy that sampled them),
    "current" (a correction, one optimizer step on fresh rollouts: pi_prox is the policy being
    trained, its log-probs the update's own) or "recomputed" (a separate forward before the
    update: later updates move the policy away from the sampler's weights, and stale rollouts,
    rl.max_staleness, were sampled by an older policy than the one the update starts from)."""
    one_update = rl.ppo_epochs == 1 and rl.num_minibatches == 1 and rl.max_staleness == 0
    if one_update and correction.mode == "none":
        return "sampler"
    return "current" if one_update and rl.proximal == "auto" else "recomputed"


def set_proximal_logprobs(
    samples: list[Sample], proximal: list[torch.Tensor], step: int, batch_mesh: DeviceMesh | None
) -> dict[str, float]:
    """Set each sample's ``prox_logprobs`` to ``proximal``, the policy's before the update (the
    weights after step ``step - 1``, trainer numerics; the sampler's own stay as they are) and return
    |log pi_prox - log pi_sampler| over completion tokens, apart for the rollouts those same
    weights sampled (``rl/sampler_logprob_diff_*``: the sampler/trainer numeric mismatch)
    and for rollouts of older weights (``rl/stale_logprob_diff_*``: the policy's drift since
    they were sampled, mismatch included); each only on steps that have such rollouts. The sums
    are taken over ``batch_mesh`` (the data-parallel ranks; CP / TP peers hold copies)."""
    # Row 0: the same weights' rollouts, row 1: older weights'; columns Σ|delta|, tokens.
    # All samples at once (a loop per sample costs more than the sums on the host).
    sums = torch.zeros(2, 2, dtype=torch.float64)
    largest = torch.zeros(2, dtype=torch.float64)
    if samples:
        lengths = [len(sample) for sample in samples]
        mask = torch.cat([sample.loss_mask for sample in samples])
        logprobs = torch.cat([p.cpu().float() for p in proximal])
        delta = (logprobs - torch.cat([sample.sampler_logprobs for sample in samples])).abs().double()[mask]
        stale = torch.tensor([int(staleness(step, sample.sampler_version) > 0) for sample in samples])
        stale = stale.repeat_interleave(torch.tensor(lengths))[mask]
        sums[:, 0].index_add_(0, stale, delta)
        sums[:, 1] = torch.bincount(stale, minlength=2).double()
        largest.scatter_reduce_(0, stale, delta, "amax")
        for sample, values in zip(samples, torch.where(mask, logprobs, 0.0).split(lengths)):
            sample.prox_logprobs = values.clone()  # not a view: a sample may be pickled alone
    if batch_mesh is not None:
        dist.all_reduce(sums, group=batch_mesh.get_group())
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=batch_mesh.get_group())
    values = {}
    for row, name in enumerate(("sampler", "stale")):
        total, num_tokens = sums[row].tolist()
        if num_tokens:
            values[f"rl/{name}_logprob_diff_mean"] = total / num_tokens
            values[f"rl/{name}_logprob_diff_max"] = float(largest[row])
    return values
