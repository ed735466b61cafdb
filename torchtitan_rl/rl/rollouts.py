"""From a step's prompts to training samples: which rank generates what, the rollout exchange,
advantages, the per-token RL inputs, and the compute balancing of the samples over the
data-parallel ranks.

Layout independence (docs/design.md, 'The RL step'): the step's prompts come from one global stream, every rank
derives its share from (prompt index, mini-batch, data-parallel rank) alone, and each rollout's
randomness from (seed, step, prompt, sample) alone, so the rollout batch of a step is the same
for every parallel layout. Context- and tensor-parallel peers of a data-parallel rank hold the
same samples: they split the generation work and exchange the rollouts, so all of them train
on identical rollouts.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.balance import DEFAULT_COST_MODEL, CostModel, assign_to_ranks, rank_loads
from torchtitan_rl.data.sample import Sample, SampleImage
from torchtitan_rl.data.vision_samples import VisionDataConfig, image_vision_rows, load_images
from torchtitan_rl.distributed.utils import all_to_all_objects
from torchtitan_rl.rl.advantages import group_advantages, zero_variance_groups
from torchtitan_rl.rl.env_rollouts import EpisodeRollout
from torchtitan_rl.rl.generator import PromptImages, Rollout, RolloutEngine, SamplingParams
from torchtitan_rl.rl.length_shaping import is_penalized
from torchtitan_rl.rl.rollout_dump import rollout_info
from torchtitan_rl.rl.tasks import Reward
from torchtitan_rl.rl.tasks.rewards import OVERLONG_COMPONENT


class PromptStream:
    """Indices into a task's training pool: ``prompts_per_step`` per step, in a fresh seeded
    order every epoch, identical on every rank. Checkpointable (epoch and position)."""

    def __init__(self, num_problems: int, prompts_per_step: int, seed: int):
        if num_problems < 1:
            raise ValueError("the task has no training prompts")
        self.num_problems = num_problems
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self._epoch)
        return torch.randperm(self.num_problems, generator=generator).tolist()

    def next_step(self) -> list[int]:
        indices = []
        while len(indices) < self.prompts_per_step:
            if self._position == self.num_problems:
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order()
            indices.append(self._order[self._position])
            self._position += 1
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch, self._position = int(state_dict["epoch"]), int(state_dict["position"])
        self._order = self._epoch_order()


def rank_prompt_slots(num_prompts: int, num_minibatches: int, dp_rank: int, dp_degree: int) -> list[list[int]]:
    """Per mini-batch, the step's prompt slots (0..num_prompts-1) this data-parallel rank trains.

    Mini-batch m is the same global set of prompts for any DP degree (slots m·P/M ..
    (m+1)·P/M − 1); each rank holds a contiguous share of it.
    """
    per_minibatch = num_prompts // num_minibatches
    share = per_minibatch // dp_degree
    assert share * dp_degree * num_minibatches == num_prompts, (num_prompts, num_minibatches, dp_degree)
    return [
        list(range(m * per_minibatch + dp_rank * share, m * per_minibatch + (dp_rank + 1) * share))
        for m in range(num_minibatches)
    ]


def split_among_peers(items: list, peer_rank: int, num_peers: int) -> list:
    """This peer's contiguous part of ``items`` (sizes differ by at most one)."""
    base, extra = divmod(len(items), num_peers)
    start = peer_rank * base + min(peer_rank, extra)
    return items[start : start + base + (1 if peer_rank < extra else 0)]


def generate_share(
    generator: RolloutEngine,
    step_prompts: list[list[int]],
    slots: list[int],
    num_samples: int,
    params: SamplingParams,
    seed: int,
    step: int,
    peer_mesh: DeviceMesh | None,
    index_offset: int = 0,
    step_images: list[PromptImages] | None = None,
) -> list[Rollout]:
    """This peer's part of the rollouts of ``slots`` (indices into ``step_prompts``, the step's
    prompt tokens, and ``step_images``, their images); ``exchange_among_peers`` then gives every
    peer all of them.

    A rollout's prompt index, which keys its randomness, is ``index_offset + slot``: dynamic
    sampling's later rounds of a step pass an offset so that their keys are new
    (``rl/dynamic_sampling.py``).
    """
    peer_rank, num_peers = (0, 1) if peer_mesh is None else (peer_mesh.get_local_rank(), peer_mesh.size())
    mine = split_among_peers(slots, peer_rank, num_peers)
    indices = [index_offset + s for s in mine]
    images = None if step_images is None else [step_images[s] for s in mine]
    return generator.generate([step_prompts[s] for s in mine], indices, num_samples, params, seed, step, images)


def exchange_among_peers(local: list, peer_mesh: DeviceMesh | None) -> list:
    """Every peer's ``local`` list, concatenated in peer order, on every peer."""
    if peer_mesh is None:
        return local
    gathered: list = [None] * peer_mesh.size()
    dist.all_gather_object(gathered, local, group=peer_mesh.get_group())
    return [item for part in gathered for item in part]


@dataclass
class ScoredGroup:
    """The rollouts of one prompt with their rewards and advantages."""

    slot: int  # the prompt's position in the step (its group id)
    rollouts: list[Rollout]
    rewards: list[Reward]
    advantages: list[float]


def score_groups(
    rollouts: list[Rollout], rewards: list[Reward], group_size: int, estimator: str, eps: float
) -> list[ScoredGroup]:
    """Group ``rollouts`` (ordered by prompt, then sample) and compute their advantages (0 under
    ``gae``, whose advantages are per token)."""
    if estimator == "gae":
        # Per-token advantages come later, from the critic's values (``rl.gae``).
        advantages = [0.0] * len(rollouts)
    else:
        totals = torch.tensor([r.total for r in rewards], dtype=torch.float64)
        group_ids = torch.tensor([r.prompt_index for r in rollouts])
        advantages = group_advantages(totals, group_ids, estimator, eps).tolist()
    return [
        ScoredGroup(
            rollouts[i].prompt_index,
            rollouts[i : i + group_size],
            rewards[i : i + group_size],
            advantages[i : i + group_size],
        )
        for i in range(0, len(rollouts), group_size)
    ]


def is_zero_variance(group: ScoredGroup) -> bool:
    totals = torch.tensor([r.total for r in group.rewards], dtype=torch.float64)
    return bool(zero_variance_groups(totals, torch.zeros(len(totals), dtype=torch.long)).all())


def is_truncated(rollout: Rollout) -> bool:
    """Whether ``rollout`` was cut at ``max_new_tokens`` instead of ending with a stop token."""
    return rollout.stop_reason == "length"


def to_samples(
    groups: list[ScoredGroup], max_len: int, mask_truncated: bool = False, vision: VisionDataConfig | None = None
) -> list[Sample]:
    """One training sample per rollout: the loss covers the completion (stop token included),
    whose tokens carry the group advantage and the sampler's log-probs; the group id is the
    prompt's slot in the step. With ``mask_truncated`` a truncated completion carries no loss
    token (its reward still entered its group's advantages). A prompt's images (decoded with
    ``vision``, once per group) go with every sample of its group, as in the generator's prefill."""
    samples = []
    for group in groups:
        images = _group_images(group, vision)
        for rollout, reward, advantage in zip(group.rollouts, group.rewards, group.advantages):
            tokens = rollout.prompt_tokens + rollout.completion_tokens
            if len(tokens) - 1 > max_len:
                raise ValueError(
                    f"a rollout of {len(tokens) - 1} tokens exceeds training.seq_len={max_len}; raise it to at "
                    "least the longest prompt plus generation.max_new_tokens"
                )
            num_prompt, num_completion = len(rollout.prompt_tokens) - 1, len(rollout.completion_tokens)
            ids = torch.tensor(tokens, dtype=torch.long)
            trained = not (mask_truncated and is_truncated(rollout))
            # An episode's observation tokens sit among its completion tokens but carry no loss.
            sampled = rollout.loss_mask if isinstance(rollout, EpisodeRollout) else [True] * num_completion
            sampled = torch.tensor(sampled, dtype=torch.bool)
            completion = torch.cat([torch.zeros(num_prompt, dtype=torch.bool), sampled & trained])
            logprobs = torch.tensor(rollout.logprobs, dtype=torch.float32)
            samples.append(
                Sample(
                    input_ids=ids[:-1],
                    labels=ids[1:].clone(),
                    loss_mask=completion,
                    advantages=completion.float() * advantage,
                    sampler_logprobs=torch.cat([torch.zeros(num_prompt), logprobs]),
                    group_id=group.slot,
                    sampler_version=rollout.version,
                    rollout_info=rollout_info(
                        group.slot,
                        rollout,
                        reward,
                        advantage,
                        float(logprobs[sampled].double().mean()) if bool(sampled.any()) else None,
                    ),
                )
            )
            if images:
                samples[-1].images = images
                samples[-1].vision_rows = image_vision_rows(rollout.images, len(tokens) - 1, vision.merge_size)
            if rollout.routing is not None:
                samples[-1].routed_experts = routed_experts(rollout.routing, len(tokens) - 1)
    return samples


def routed_experts(routing: np.ndarray, num_inputs: int) -> torch.Tensor:
    """A sample's ``routed_experts`` ``[num_inputs, L, k]`` (int16) from its rollout's recorded
    ``routing`` of its last input positions (``Rollout.routing``): -1 before them."""
    recorded = torch.from_numpy(np.ascontiguousarray(routing)).to(torch.int16)
    assert recorded.shape[0] <= num_inputs, (recorded.shape, num_inputs)
    missing = torch.full((num_inputs - recorded.shape[0], *recorded.shape[1:]), -1, dtype=torch.int16)
    return torch.cat([missing, recorded])


def _group_images(group: ScoredGroup, vision: VisionDataConfig | None) -> list[SampleImage]:
    """The decoded images of ``group``'s prompt (every rollout of a group has the same), or []."""
    images = group.rollouts[0].images if group.rollouts else ()
    if not images:
        return []
    if vision is None:
        raise ValueError("rollouts of prompts with images need the vision settings of a vision-language model")
    return load_images(images, vision)


# ------------------------------------------------------------------ DP compute balancing

# A sample of a mini-batch: (the data-parallel rank whose prompt share produced it, its index
# in that rank's list of the mini-batch).
SampleKey = tuple[int, int]


def plan_dp_balance(
    lengths: list[list[list[int]]],
    balance: bool,
    max_tokens: int = 0,
    patches: list[list[list[int]]] | None = None,
    max_patches: int = 0,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> tuple[list[list[list[SampleKey]]], dict]:
    """Which samples every data-parallel rank trains in every mini-batch, and how even the work is.

    ``lengths[r][m]`` are the token counts of rank r's samples of mini-batch m, i.e. of the
    rollouts of its own prompt share (``rank_prompt_slots``) in slot, then sample order. The
    shares are contiguous in rank order, so rank 0's samples, then rank 1's, ... is the
    mini-batch in global (slot, sample) order, whatever the timing of generation.

    Returns ``plan[m][r]``, the keys rank r trains in mini-batch m in that global order, and the
    step's ``dp_cost_imbalance`` of the split used, of the ranks' own shares (``_contiguous``)
    and of the balanced split (``_balanced``): Σ over mini-batches of the slowest rank's
    ``cost_model`` over Σ of the mean rank cost, since every update waits for its
    slowest rank (1.0 is even; with one mini-batch, SFT's max / mean). With ``balance`` every
    mini-batch is split by ``assign_to_ranks`` over its global order, for micro-batches of
    ``max_tokens`` tokens, unless the own shares have no higher estimated step cost (then
    nothing moves). A vision-language model's samples also cost their images' vision patches
    (``patches``, shaped like ``lengths``), and micro-batches hold at most ``max_patches`` of
    them. A pure function of the sizes: every rank computes
    the same plan. The gradient does not depend on it (docs/design.md, 'Loss weights'; group
    ids are global prompt slots, so ``prompt_mean`` counts a group spread over ranks whole).
    """
    num_ranks = len(lengths)
    plan: list[list[list[SampleKey]]] = []
    slowest = {"": 0.0, "_contiguous": 0.0, "_balanced": 0.0}
    total_mean = 0.0
    for m in range(len(lengths[0])):
        keys = [(r, i) for r in range(num_ranks) for i in range(len(lengths[r][m]))]
        num_patches = [patches[r][m][i] for r, i in keys] if patches is not None else [0] * len(keys)
        costs = [cost_model.sample_cost(lengths[r][m][i], p) for (r, i), p in zip(keys, num_patches)]
        own = [[g for g, (r, _) in enumerate(keys) if r == rank] for rank in range(num_ranks)]
        balanced = assign_to_ranks(
            [lengths[r][m][i] for r, i in keys],
            num_ranks,
            num_patches=num_patches if patches is not None else None,
            max_tokens=max_tokens,
            max_patches=max_patches,
            fallback=own,
            cost_model=cost_model,
        )
        chosen = balanced if balance else own
        for suffix, split in (("", chosen), ("_contiguous", own), ("_balanced", balanced)):
            slowest[suffix] += max(rank_loads(costs, split))
        total_mean += sum(costs) / num_ranks
        plan.append([[keys[i] for i in indices] for indices in chosen])
    stats = {
        f"dp_cost_imbalance{suffix}": value / total_mean if total_mean > 0 else 1.0 for suffix, value in slowest.items()
    }
    return plan, stats


def _moves(plan: list[list[list[SampleKey]]], source: int, dest: int) -> list[tuple[int, int]]:
    """(mini-batch, index) of rank ``source``'s samples that rank ``dest`` trains, in an order
    both derive from the plan alone."""
    return [(m, i) for m, ranks in enumerate(plan) for s, i in ranks[dest] if s == source]


def _to_wire(sample: Sample) -> dict:
    """``sample``'s fields with its tensors as numpy arrays: pickling a numpy array copies one
    buffer, a torch tensor goes through torch's much slower storage serialization.
    Images travel as (patches, rows, cols)."""
    fields = {
        field.name: value.numpy() if isinstance(value, torch.Tensor) else value
        for field in dataclasses.fields(sample)
        if field.name != "images"
        for value in (getattr(sample, field.name),)
    }
    if sample.images is not None:
        fields["images"] = [(image.patches.numpy(), image.rows, image.cols) for image in sample.images]
    return fields


def _from_wire(fields: dict) -> Sample:
    fields = dict(fields)
    images = fields.pop("images", None)
    sample = Sample(**{name: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for name, v in fields.items()})
    if images is not None:
        sample.images = [SampleImage(torch.from_numpy(patches), rows, cols) for patches, rows, cols in images]
    return sample


def outgoing_samples(plan: list[list[list[SampleKey]]], rank: int, minibatches: list[list[Sample]]) -> list[list[dict]]:
    """Per rank r, this rank's samples that r trains under ``plan`` (``plan_dp_balance``), in
    ``_moves`` order, in the form sent over the wire; none for this rank itself."""
    return [
        [] if dest == rank else [_to_wire(minibatches[m][i]) for m, i in _moves(plan, rank, dest)]
        for dest in range(len(plan[0]))
    ]


def assemble_minibatches(
    plan: list[list[list[SampleKey]]], rank: int, minibatches: list[list[Sample]], received: list[list[dict]]
) -> list[list[Sample]]:
    """This rank's samples of every mini-batch under ``plan``, in global order: the ones it keeps
    from ``minibatches`` (its own) and the ones other ranks sent it (``received[s]``: what rank
    s's ``outgoing_samples`` addressed to this rank)."""
    arrived: dict[tuple[int, int, int], dict] = {}
    for source, samples in enumerate(received):
        if source != rank:
            moved = _moves(plan, source, rank)
            assert len(moved) == len(samples), (source, len(moved), len(samples))
            arrived.update({(m, source, i): fields for (m, i), fields in zip(moved, samples)})
    return [
        [minibatches[m][i] if source == rank else _from_wire(arrived[(m, source, i)]) for source, i in ranks[rank]]
        for m, ranks in enumerate(plan)
    ]


def balance_over_data_parallel(
    minibatches: list[list[Sample]],
    batch_mesh: DeviceMesh | None,
    balance: bool,
    max_tokens: int = 0,
    max_patches: int | None = None,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> tuple[list[list[Sample]], dict]:
    """This rank's samples of every mini-batch after compute balancing (``plan_dp_balance``) over
    the ``batch`` mesh for micro-batches of ``max_tokens`` tokens (and, for a vision-language
    model, ``max_patches`` vision patches; None: a text model) by the model's ``cost_model``,
    and the step's imbalance stats (computed with balancing off too).

    Host collectives per step, all mini-batches at once: an object all-gather of the sample
    lengths (a few ints per sample; every rank then derives the same plan), then, only when
    some sample moves, an all-to-all (``all_to_all_objects``) that takes each moving sample to
    the rank that trains it and nowhere else: a rank receives only samples it trains, and
    samples that stay are never sent. CP / TP peers hold identical samples, so each of their
    ``batch`` groups computes the same plan and exchanges the same copies.
    """
    local = [[len(sample) for sample in mb] for mb in minibatches]
    local_patches = None if max_patches is None else [[sample.num_patches for sample in mb] for mb in minibatches]
    if batch_mesh is None:
        patches = None if local_patches is None else [local_patches]
        return minibatches, plan_dp_balance([local], balance, max_tokens, patches, max_patches or 0, cost_model)[1]
    sizes: list = [None] * batch_mesh.size()
    dist.all_gather_object(sizes, (local, local_patches), group=batch_mesh.get_group())
    lengths = [rank_lengths for rank_lengths, _ in sizes]
    patches = None if max_patches is None else [rank_patches for _, rank_patches in sizes]
    plan, stats = plan_dp_balance(lengths, balance, max_tokens, patches, max_patches or 0, cost_model)
    if all(source == dest for ranks in plan for dest, keys in enumerate(ranks) for source, _ in keys):
        return minibatches, stats  # every rank knows that nothing moves: no second collective
    rank = batch_mesh.get_local_rank()
    received = all_to_all_objects(outgoing_samples(plan, rank, minibatches), batch_mesh)
    return assemble_minibatches(plan, rank, minibatches, received), stats


# Sums over the step's rollouts, reduced over the `batch` mesh (peers hold copies: never summed).
_SUMS = (
    "num_rollouts",
    "reward",
    "reward_sq",
    "correct",
    "length",
    "truncated",
    "num_groups",
    "groups_all_correct",
    "groups_all_wrong",
    "filtered_groups",
    "overlong_penalized",
)


def rollout_sums(
    groups: list[ScoredGroup], filtered: int, masked_truncated: int | None = None
) -> tuple[dict[str, float], float, dict[str, float]]:
    """(sums of ``_SUMS``, the longest response, sums of each reward component) of this rank's
    groups; with ``masked_truncated`` (the rank's trained rollouts whose loss was masked) also
    its sum."""
    sums = dict.fromkeys(_SUMS, 0.0)
    components: dict[str, float] = {}
    longest = 0.0
    for group in groups:
        correct = [r.correct for r in group.rewards]
        sums["num_groups"] += 1
        sums["groups_all_correct"] += all(correct)
        sums["groups_all_wrong"] += not any(correct)
        for rollout, reward in zip(group.rollouts, group.rewards):
            sums["num_rollouts"] += 1
            sums["reward"] += reward.total
            sums["reward_sq"] += reward.total**2
            sums["correct"] += reward.correct
            sums["length"] += len(rollout.completion_tokens)
            sums["truncated"] += is_truncated(rollout)
            sums["overlong_penalized"] += is_penalized(reward)
            longest = max(longest, float(len(rollout.completion_tokens)))
            for name, value in reward.components.items():
                components[name] = components.get(name, 0.0) + value
    episodes = [r for g in groups for r in g.rollouts if isinstance(r, EpisodeRollout)]
    if episodes:
        sums["turns"] = float(sum(e.num_turns for e in episodes))
        sums["episode_tokens"] = float(sum(len(e.prompt_tokens) + len(e.completion_tokens) for e in episodes))
        sums["observation_tokens"] = float(sum(e.num_observation_tokens for e in episodes))
        sums["episodes_truncated"] = float(sum(e.end_reason != "done" for e in episodes))
    sums["filtered_groups"] = float(filtered)
    if masked_truncated is not None:
        sums["masked_truncated"] = float(masked_truncated)
    return sums, longest, components


def _same_components(components: dict[str, float], has_rollouts: bool, batch_mesh: DeviceMesh) -> dict[str, float]:
    """``components`` in an order every rank of ``batch_mesh`` shares (collective), so their sums
    can be reduced as one tensor; a reward function that names its components differently on two
    ranks is a ValueError on every rank alike (a mean over the rollouts that have a component would
    not be one over the step)."""
    gathered: list = [None] * batch_mesh.size()
    dist.all_gather_object(gathered, sorted(components) if has_rollouts else None, group=batch_mesh.get_group())
    seen = {tuple(names) for names in gathered if names is not None}
    if len(seen) > 1:
        raise ValueError(
            f"the reward components differ between ranks ({' vs '.join(str(list(n)) for n in sorted(seen))}); a "
            "reward function must return the same component names for every completion"
        )
    names = seen.pop() if seen else ()
    return {name: components.get(name, 0.0) for name in names}


def rollout_metrics(
    sums: dict[str, float], longest: float, components: dict[str, float], batch_mesh: DeviceMesh | None
) -> dict[str, float]:
    """Global ``rl/*`` rollout metrics: every ratio is Σ numerator / Σ denominator over the step.
    ``rl/overlong/penalized`` appears with the overlong reward component, ``rl/masked_truncated``
    (a count) when ``sums`` has it."""
    if batch_mesh is not None:
        components = _same_components(components, sums["num_rollouts"] > 0, batch_mesh)
    names = list(sums) + [f"reward_{c}" for c in components]
    values = torch.tensor(list(sums.values()) + list(components.values()), dtype=torch.float64)
    longest_t = torch.tensor([longest], dtype=torch.float64)
    if batch_mesh is not None:
        dist.all_reduce(values, group=batch_mesh.get_group())
        dist.all_reduce(longest_t, op=dist.ReduceOp.MAX, group=batch_mesh.get_group())
    total = dict(zip(names, values.tolist()))
    n, groups = max(total["num_rollouts"], 1.0), max(total["num_groups"], 1.0)
    mean = total["reward"] / n
    out = {
        "rl/reward_mean": mean,
        "rl/reward_std": max(total["reward_sq"] / n - mean**2, 0.0) ** 0.5,
        "rl/pass@1": total["correct"] / n,
        "rl/response_length_mean": total["length"] / n,
        "rl/response_length_max": longest_t.item(),
        "rl/truncated": total["truncated"] / n,
        "rl/groups_all_correct": total["groups_all_correct"] / groups,
        "rl/groups_all_wrong": total["groups_all_wrong"] / groups,
        "rl/groups_mixed": 1.0 - (total["groups_all_correct"] + total["groups_all_wrong"]) / groups,
        "rl/filtered_groups": total["filtered_groups"],
        "rl/num_rollouts": total["num_rollouts"],
    }
    out.update({f"rl/reward_{c}": total[f"reward_{c}"] / n for c in components})
    if OVERLONG_COMPONENT in components:
        out["rl/overlong/penalized"] = total["overlong_penalized"] / n
    if "masked_truncated" in total:
        out["rl/masked_truncated"] = total["masked_truncated"]
    if "turns" in total:
        # Multi-turn episodes: each turn but the last got an observation appended (whatever the
        # environment answered: a tool's output, a hint), so turns - 1 per episode.
        out["rl/turns_mean"] = total["turns"] / n
        out["rl/observations_mean"] = (total["turns"] - total["num_rollouts"]) / n
        out["rl/episode_tokens_mean"] = total["episode_tokens"] / n
        out["rl/observation_tokens_mean"] = total["observation_tokens"] / n
        out["rl/episodes_truncated"] = total["episodes_truncated"] / n
    return out
