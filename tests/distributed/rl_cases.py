"""The GRPO rollout exchange inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``EXCHANGE_LAYOUTS`` every rank takes its data-parallel rank's prompt slots
of a step (``rank_prompt_slots``, two mini-batches), generates its peer part
(``generate_share``) and receives its peers' parts (``exchange_among_peers``), then turns each
mini-batch's rollouts into samples and balances them over the data-parallel ranks
(``balance_over_data_parallel``), exactly as the GRPO trainer does. Rank 0 records every rank's
part and results for test_rollout_exchange.py.
"""

import torch
import torch.distributed as dist

import layout_cases as lc
from generator_cases import prompts
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator
from torchtitan_rl.rl.rollouts import (
    balance_over_data_parallel,
    exchange_among_peers,
    generate_share,
    rank_prompt_slots,
    score_groups,
    to_samples,
)
from torchtitan_rl.rl.tasks import Reward

# (dp_replicate, dp_shard, cp, tp): TP peers, CP peers, and CP peers alone.
EXCHANGE_LAYOUTS = ((1, 2, 1, 2), (1, 2, 2, 1), (1, 1, 2, 1))
NUM_SAMPLES, NUM_MINIBATCHES = 2, 2
# One prompt per generation batch: batches are the same on every layout, so rollouts must be
# bitwise the same as one process generating every prompt.
MAX_PROMPTS_PER_BATCH = 1
PARAMS = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(0,))
SEED, STEP = 11, 2


def layout_key(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    return f"rollout_exchange/rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}"


def summary(rollouts) -> list[tuple]:
    return [(r.prompt_index, r.sample_index, r.completion_tokens, r.logprobs) for r in rollouts]


def sample_summary(sample) -> tuple:
    """What identifies a sample (its prompt slot and tokens) and what it carries to the loss."""
    return (
        sample.group_id,
        sample.input_ids.tolist(),
        sample.labels.tolist(),
        sample.loss_mask.tolist(),
        sample.advantages.tolist(),
        sample.sampler_logprobs.tolist(),
    )


def reward(rollout) -> Reward:
    """Any reward that differs within a group will do: the test recomputes it."""
    return Reward(float(len(rollout.completion_tokens) % 2), False, {})


def run_rollout_exchange_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in EXCHANGE_LAYOUTS:
        return
    args = lc.model_args(False)
    model = build_model(args, parallel_dims=dims, device=torch.device("cpu"), seed=lc.SEED, param_dtype=torch.float32)
    generator = TorchGenerator(args, torch.device("cpu"), max_prompts_per_batch=MAX_PROMPTS_PER_BATCH)
    generator.update_weights(model)
    step_prompts = prompts()
    slots_by_minibatch = rank_prompt_slots(len(step_prompts), NUM_MINIBATCHES, dims.batch_rank(), dims.batch_degree)
    slots = [s for mb in slots_by_minibatch for s in mb]
    peer_mesh = dims.mesh("cp_tp")
    local = generate_share(generator, step_prompts, slots, NUM_SAMPLES, PARAMS, SEED, STEP, peer_mesh)
    rollouts = exchange_among_peers(local, peer_mesh)
    groups = score_groups(rollouts, [reward(r) for r in rollouts], NUM_SAMPLES, "grpo", 1e-6)
    minibatches = [to_samples([g for g in groups if g.slot in mb], 64) for mb in slots_by_minibatch]
    balanced, imbalance = balance_over_data_parallel(minibatches, dims.mesh("batch"), True)
    mine = {
        "batch_rank": dims.batch_rank(),
        "slots": slots,
        "local": summary(local),
        "all": summary(rollouts),
        "balanced": [[sample_summary(s) for s in mb] for mb in balanced],
        "imbalance": imbalance,
    }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    results[layout_key(*layout)] = gathered
