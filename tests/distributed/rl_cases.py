"""The GRPO rollout exchange inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``EXCHANGE_LAYOUTS`` every rank takes its data-parallel rank's prompt slots
of a step (``rank_prompt_slots``, two mini-batches), generates its peer part
(``generate_share``) and receives its peers' parts (``exchange_among_peers``), exactly as the
GRPO trainer does. Rank 0 records every rank's part and result for test_rollout_exchange.py.
"""

import torch
import torch.distributed as dist

import layout_cases as lc
from generator_cases import prompts
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator
from torchtitan_rl.rl.rollouts import exchange_among_peers, generate_share, rank_prompt_slots

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


def run_rollout_exchange_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in EXCHANGE_LAYOUTS:
        return
    args = lc.model_args(False)
    model = build_model(args, parallel_dims=dims, device=torch.device("cpu"), seed=lc.SEED, param_dtype=torch.float32)
    generator = TorchGenerator(args, torch.device("cpu"), max_prompts_per_batch=MAX_PROMPTS_PER_BATCH)
    generator.update_weights(model)
    step_prompts = prompts()
    slots = [
        s
        for mb in rank_prompt_slots(len(step_prompts), NUM_MINIBATCHES, dims.batch_rank(), dims.batch_degree)
        for s in mb
    ]
    peer_mesh = dims.mesh("cp_tp")
    local = generate_share(generator, step_prompts, slots, NUM_SAMPLES, PARAMS, SEED, STEP, peer_mesh)
    rollouts = exchange_among_peers(local, peer_mesh)
    mine = {"batch_rank": dims.batch_rank(), "slots": slots, "local": summary(local), "all": summary(rollouts)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    results[layout_key(*layout)] = gathered
