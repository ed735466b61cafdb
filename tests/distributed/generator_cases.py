"""Rollout generator checks inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``GENERATOR_LAYOUTS``: one training step, then ``update_weights`` from the
sharded model (``full_tensor`` gathers on every rank), rollouts of this rank's share of the
prompts, and the engine's log-probs of each prompt + completion. Everything is gathered so
that rank 0 records the whole step for ``test_generator_distributed.py``.
"""

from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import layout_cases as lc
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator

# (dp_replicate, dp_shard, cp, tp): FSDP, FSDP + TP, HSDP, TP.
GENERATOR_LAYOUTS = ((1, 2, 1, 1), (1, 2, 1, 2), (2, 2, 1, 1), (1, 1, 1, 2))
PROMPT_LENS = (1, 9, 3, 14, 5, 2, 11, 6)
NUM_SAMPLES = 2
# Divides every layout's share of the prompts (8 over 1, 2 or 4 batch ranks): the batches are
# the same on every layout, so the rollouts must be bitwise the same.
MAX_PROMPTS_PER_BATCH = 2
TEMPERATURE = 0.7
PARAMS = SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, top_p=0.95, stop_token_ids=(0, 1))
SEED, STEP = 7, 3


def layout_key(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    return f"generator/rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}"


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(6)
    return [torch.randint(0, lc.VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def share(items: list, dims: ParallelDims) -> list:
    """This rank's contiguous share of ``items``, by batch rank."""
    n = len(items) // dims.batch_degree
    return items[dims.batch_rank() * n : (dims.batch_rank() + 1) * n]


def completion_samples(rollouts) -> list[Sample]:
    """prompt + completion, with the completion as the loss tokens."""
    return [
        Sample.from_tokens(
            r.prompt_tokens + r.completion_tokens, [False] * len(r.prompt_tokens) + [True] * len(r.completion_tokens)
        )
        for r in rollouts
    ]


def count_gathers(generator: TorchGenerator, model: torch.nn.Module) -> dict:
    """``update_weights``, counting its ``full_tensor`` calls, and the DTensor parameters."""
    with mock.patch.object(DTensor, "full_tensor", autospec=True, side_effect=DTensor.full_tensor) as spy:
        generator.update_weights(model)
    return {"calls": spy.call_count, "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters())}


def tied_weights(dims: ParallelDims) -> dict:
    """A tied model at init loaded into a tied generator: one gather for the shared weight."""
    args = lc.model_args(True)
    model = build_model(args, parallel_dims=dims, device=torch.device("cpu"), seed=lc.SEED, param_dtype=torch.float32)
    generator = TorchGenerator(args, torch.device("cpu"))
    return {
        "gathers": count_gathers(generator, model),
        "still_tied": generator.model.output.weight is generator.model.tok_embeddings.weight,
        "trained": {fqn: full(p) for fqn, p in model.named_parameters()},
        "replica": {fqn: p.detach().clone() for fqn, p in generator.model.named_parameters()},
    }


def run_generator_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in GENERATOR_LAYOUTS:
        return
    device = torch.device("cpu")
    args = lc.model_args(False)
    model = build_model(args, parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32)
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    # One micro-batch per rank (budget 0): the fewest passes.
    options = EngineOptions(
        reduction="token_mean",
        horizon=lc.HORIZON,
        max_tokens_per_microbatch=0,
        logits_chunk_size=16,
        max_norm=0.0,
        temperature=TEMPERATURE,
    )
    engine = Engine(
        model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
    )
    engine.forward_backward(share(lc.global_batch("uneven"), dims))
    engine.optim_step()

    generator = TorchGenerator(args, device, max_prompts_per_batch=MAX_PROMPTS_PER_BATCH)
    gathers = count_gathers(generator, model)
    indices = share(list(range(len(PROMPT_LENS))), dims)
    rollouts = generator.generate([prompts()[i] for i in indices], indices, NUM_SAMPLES, PARAMS, SEED, STEP)
    logprobs = engine.forward(completion_samples(rollouts)).logprobs
    completion_logprobs = [lp[len(r.prompt_tokens) - 1 :] for r, lp in zip(rollouts, logprobs)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (rollouts, completion_logprobs))
    results[layout_key(*layout)] = {
        "trained": {fqn: full(p) for fqn, p in model.named_parameters()},
        "replica": {fqn: p.detach().clone() for fqn, p in generator.model.named_parameters()},
        "gathers": gathers,
        "tied": tied_weights(dims),
        # Every rank's rollouts (TP ranks of one batch rank hold the same ones).
        "rollouts": [r for rank_rollouts, _ in gathered for r in rank_rollouts],
        "engine_logprobs": [lp for _, rank_logprobs in gathered for lp in rank_logprobs],
    }
