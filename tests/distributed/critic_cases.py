"""A critic's value loss inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``CRITIC_LAYOUTS`` (one rank, dp 2, tp 2, cp 2, dp2 x tp2, dp2 x cp2) a
``CriticEngine`` on the tiny model with a value head reads the values of the samples below
(multi-turn: sampled spans separated by observation tokens) and trains on the clipped value
loss against fixed returns and old values, under every reduction mode; ``BUDGET`` packs each
rank's share into several micro-batches. Rank 0 records each mode's gradients and metrics, and
every sample's values; then the samples' PPO targets from those values (GAE, advantages
whitened over the data-parallel ranks), for test_critic_layout.py. Kept free of any reference computation.
"""

import torch

import layout_cases as lc
from rl_cases import gather_to_all
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import EngineOptions
from torchtitan_rl.engine_values import CriticEngine
from torchtitan_rl.losses.reduction import NUM_MICROBATCHES
from torchtitan_rl.models.qwen3.args import as_critic
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.gae import set_critic_targets, target_metrics

CRITIC_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 2), (1, 2, 2, 1))
MODES = ("sum", "token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")
BUDGET = 24
CLIP = 0.2
VALUE_COEF = 0.5
# Per sample: the prompt length, then alternating (sampled, observation) span lengths.
EPISODES = ((3, 4, 2, 3), (2, 6), (5, 2, 3, 1, 2, 2), (1, 3), (4, 5, 1, 2), (2, 1, 4, 3), (3, 7), (6, 2, 2, 2))
GROUPS = (0, 0, 1, 1, 2, 2, 3, 3)
EPISODE_REWARDS = (1.0, 0.0, 0.5, -1.0, 2.0, 0.0, 1.0, 0.25)
GAMMA, LAM = 0.95, 0.9


def global_samples() -> list[Sample]:
    """The episodes with random tokens, returns and old values near the returns (so clipping
    binds on some tokens and not on others)."""
    gen = torch.Generator().manual_seed(91)
    samples = []
    for index, (prompt, *spans) in enumerate(EPISODES):
        mask = [False] * prompt
        for k, span in enumerate(spans):
            mask += [k % 2 == 0] * span
        mask += [True]  # the episode ends on a sampled token
        tokens = torch.randint(0, lc.VOCAB, (len(mask) + 1,), generator=gen).tolist()
        sample = Sample.from_tokens(tokens, [False] + mask)
        n = len(sample)
        sample.returns = torch.randn(n, generator=gen) * sample.loss_mask
        sample.old_values = torch.randn(n, generator=gen) * 0.3
        sample.group_id = GROUPS[index]
        samples.append(sample)
    return samples


def rank_indices(dims: ParallelDims) -> list[int]:
    share = len(EPISODES) // dims.batch_degree
    return list(range(dims.batch_rank() * share, (dims.batch_rank() + 1) * share))


def case_key(layout: tuple, mode: str) -> str:
    return "critic/rep{}_shard{}_cp{}_tp{}".format(*layout) + f"/{mode}"


def run_critic_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in CRITIC_LAYOUTS:
        return
    model = build_model(
        as_critic(lc.model_args()),
        parallel_dims=dims,
        device=torch.device("cpu"),
        seed=lc.SEED,
        param_dtype=torch.float32,
    )
    indices = rank_indices(dims)
    samples = [global_samples()[i] for i in indices]
    for mode in MODES:
        options = EngineOptions(
            reduction=mode, horizon=lc.HORIZON, max_tokens_per_microbatch=BUDGET, logits_chunk_size=16, max_norm=0.0
        )
        engine = CriticEngine(
            model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=torch.device("cpu"), options=options
        )
        values = engine.values(samples)
        metrics = engine.value_forward_backward(samples, CLIP, VALUE_COEF)
        record = {
            "grads": {fqn: lc.full(p.grad) for fqn, p in model.named_parameters() if p.requires_grad},
            "metrics": metrics.reduce(dims.trainer_group()),
            "values": gather_to_all(dict(zip(indices, values))),
            "num_microbatches": int(engine.prepare(samples).local_counts[NUM_MICROBATCHES]),
        }
        model.zero_grad(set_to_none=True)
        results[case_key(layout, mode)] = record
    # GAE from the critic's values, advantages whitened over the data-parallel ranks.
    rewards = [EPISODE_REWARDS[i] for i in indices]
    set_critic_targets(samples, values, rewards, GAMMA, LAM, dims.mesh("batch"))
    targets = {i: (s.advantages, s.returns, s.old_values) for i, s in zip(indices, samples)}
    results[case_key(layout, "targets")] = gather_to_all(targets)
    results[case_key(layout, "target_metrics")] = target_metrics(samples, dims.mesh("batch"))
