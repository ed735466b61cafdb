"""FSDP reshard-after-forward policies inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On ``RESHARD_LAYOUTS`` the dense model of ``layout_cases`` trains for two clipped AdamW steps
under each policy, with several micro-batches per rank and an ``Engine.forward`` between the
first ``forward_backward`` and its optimizer step: the order in which a group left gathered by
a forward without backward would make the step miss its gradients and the next forward use
stale weights. Rank 0 records the gradients, logged numbers and parameters of both steps, the
forward's log-probs, and which FSDP groups hold gathered parameters right after each forward
(before its backward) and after ``Engine.forward``. A MoE model and a VLM record the same
gathered groups. Kept free of any reference computation: test_fsdp_reshard.py has them.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import layout_cases as lc
import moe_cases
import vlm_cases
from generator_cases import full, share
from torchtitan_rl.data.packing import VisionPacking
from torchtitan_rl.distributed.fsdp import RESHARD_POLICIES
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.reduction import NUM_LOSS_TOKENS
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model

# Data parallel only: without TP a sharded parameter is a DTensor and a gathered one a plain
# tensor (FSDP2 registers one or the other), which is what the records read.
RESHARD_LAYOUTS = ((1, 2, 1, 1),)
STEP_DATA = ("uneven", "other")  # the mini-batch of each optimizer step
BUDGET = 24  # several micro-batches per rank
TOTAL_STEPS = 10  # of the linear schedule (no warmup, decays to 0)


def key(layout: tuple, model: str, policy: str) -> str:
    return "reshard/rep{}_shard{}_cp{}_tp{}".format(*layout) + f"/{model}/{policy}"


def _own_params(group: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters an FSDP group manages: its own, not those of FSDP groups nested in it."""
    params, stack = [], [group]
    while stack:
        module = stack.pop()
        params += module.parameters(recurse=False)
        stack += [child for child in module.children() if not isinstance(child, FSDPModule)]
    return params


def gathered_groups(model: torch.nn.Module) -> list[str]:
    """Names of the FSDP groups below the root whose parameters are gathered now."""
    names = []
    for name, module in model.named_modules():
        if module is model or not isinstance(module, FSDPModule):
            continue
        sharded = {isinstance(p, DTensor) for p in _own_params(module)}
        assert len(sharded) == 1, (name, sharded)  # a group is gathered or sharded as a whole
        if not sharded.pop():
            names.append(name)
    return names


def record_gathered_after_forward(model: torch.nn.Module) -> list[list[str]]:
    """A list that gets ``gathered_groups`` after every forward of the whole model (the blocks'
    own post-forward steps have run by then; backward has not started)."""
    records: list[list[str]] = []
    model.register_forward_hook(lambda module, args, out: records.append(gathered_groups(module)))
    return records


def all_sharded(model: torch.nn.Module) -> bool:
    return all(isinstance(p, DTensor) for p in model.parameters())


def run_reshard_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in RESHARD_LAYOUTS:
        return
    for policy in RESHARD_POLICIES:
        _train_two_steps(dims, layout, policy, results)
        _moe_and_vlm_groups(dims, layout, policy, results)


def _train_two_steps(dims: ParallelDims, layout: tuple, policy: str, results: dict) -> None:
    device = torch.device("cpu")
    model = build_model(
        lc.model_args(False),
        parallel_dims=dims,
        device=device,
        seed=lc.SEED,
        param_dtype=torch.float32,
        reshard_after_forward=policy,
    )
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, TOTAL_STEPS, 0, "linear", 0.0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    metrics = MetricsLogger(dims, device, rank, tb_folder=None, num_params=1, flops_per_token_context=1)
    options = EngineOptions(
        reduction="token_mean",
        horizon=lc.HORIZON,
        max_tokens_per_microbatch=BUDGET,
        logits_chunk_size=16,
        max_norm=lc.MAX_NORM,
    )
    engine = Engine(
        model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
    )
    records = record_gathered_after_forward(model)
    steps = []
    for step, variant in enumerate(STEP_DATA, start=1):
        records.clear()
        fb = engine.forward_backward(share(lc.global_batch(variant), dims))
        entry = {
            "gathered_before_backward": list(records),
            "grads": {n: full(p.grad) for n, p in model.named_parameters()},
        }
        if step == 1:
            # Log-probs for old / reference values, between backward and the optimizer step.
            records.clear()
            entry["forward_logprobs"] = engine.forward(share(lc.global_batch("uneven"), dims)).logprobs
            entry["gathered_in_forward"] = list(records)
            entry["sharded_after_forward"] = all_sharded(model)
        optim = engine.optim_step()
        entry["logged"] = metrics.log(
            step,
            fb=fb,
            optim=optim,
            window_tokens=fb.counts[NUM_LOSS_TOKENS],
            window_squared_lens=fb.counts[NUM_LOSS_TOKENS],
            window_seconds=1.0,
            data_stats={},
        )
        entry["params"] = {n: full(p) for n, p in model.named_parameters()}
        steps.append(entry)
    results[key(layout, "dense", policy)] = steps


def _moe_and_vlm_groups(dims: ParallelDims, layout: tuple, policy: str, results: dict) -> None:
    """Gathered groups before backward (every micro-batch) and after ``Engine.forward``."""
    device = torch.device("cpu")
    setups = {
        "moe": (
            moe_cases.model_args(),
            {"router": moe_cases.ROUTER_CONFIGS["sequence_pooled"]},
            share(lc.global_batch("uneven"), dims),
        ),
        "vlm": (
            vlm_cases.model_args(),
            {"vision": VisionPacking(vlm_cases.PATCH_DIM, vlm_cases.MERGE)},
            vlm_cases.rank_samples(vlm_cases.global_batch(), dims, balance=False),
        ),
    }
    for name, (args, extra, samples) in setups.items():
        model = build_model(
            args,
            parallel_dims=dims,
            device=device,
            seed=lc.SEED,
            param_dtype=torch.float32,
            reshard_after_forward=policy,
        )
        options = EngineOptions(
            reduction="token_mean",
            horizon=lc.HORIZON,
            max_tokens_per_microbatch=BUDGET,
            logits_chunk_size=16,
            max_norm=0.0,
            **extra,
        )
        engine = Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=device, options=options)
        records = record_gathered_after_forward(model)
        engine.forward_backward(samples)
        entry = {"gathered_before_backward": list(records)}
        engine.forward(samples)
        entry["sharded_after_forward"] = all_sharded(model)
        results[key(layout, name, policy)] = entry
