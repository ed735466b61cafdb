"""Pipeline parallel inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

Each layout of ``PIPELINE_LAYOUTS`` splits a deeper version of the layout model over its
pipeline ranks, composed with FSDP, HSDP, tensor and context parallel, and runs the cases
below through a ``PipelineEngine``: every SFT reduction mode (on 2 ranks; token_mean and sum on
more), the PPO loss with KL, entropy and rollout weights under prompt_mean, GSPO's per-sequence
ratios, a clipped AdamW step, and the forward log-probs and entropies. ``LORA_LAYOUT`` also
trains adapters and exports them (PEFT and merged); ``MOE_LAYOUTS`` run a MoE model whose first
stage is dense under every router-loss case of ``MOE_CASES``, one of them with expert parallel,
one (``MOE_REPLAY_LAYOUT``) also with routing replay;
``VLM_LAYOUTS`` a vision-language model whose first stage encodes the images. On 4 ranks a
checkpoint of one split loads into another split and into no pipeline. Rank 0 records the whole gradient
(every stage's, gathered), the logged metrics, the stepped weights, the log-probs and the
exports, for test_pipeline_layout.py. Kept free of any reference computation.
"""

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import layout_cases as lc
import lora_cases
import moe_cases
import vlm_cases
from torchtitan_rl.checkpoint import _ModelState, _OptimizerState
from torchtitan_rl.data.packing import VisionPacking
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.pipeline import plan_pipeline
from torchtitan_rl.engine import EngineOptions
from torchtitan_rl.engine_pipeline import PipelineEngine
from torchtitan_rl.losses.reduction import NUM_LOSS_TOKENS, REDUCTION_MODES
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.peft_checkpoint import save_merged_hf, save_peft_adapter
from torchtitan_rl.recipes.base import build_model

# Enough layers for two stages on each of 4 pipeline ranks.
NUM_LAYERS = 8
BUDGET = 24  # several micro-batches per rank
# world size -> (pp, dp_replicate, dp_shard, cp, tp, schedule) layouts.
PIPELINE_LAYOUTS = {
    2: ((2, 1, 1, 1, 1, "1F1B"), (2, 1, 1, 1, 1, "GPipe"), (2, 1, 1, 1, 1, "ZBVZeroBubble")),
    4: (
        (2, 1, 2, 1, 1, "1F1B"),
        (2, 2, 1, 1, 1, "1F1B"),
        (2, 1, 1, 1, 2, "1F1B"),
        (2, 1, 1, 2, 1, "1F1B"),
        (2, 1, 2, 1, 1, "Interleaved1F1B"),
        (4, 1, 1, 1, 1, "InterleavedZeroBubble"),
    ),
    8: ((2, 1, 2, 1, 2, "1F1B"),),
}
# (loss_fn, reduction mode, data); the step case runs last. token_mean_legacy depends on the
# micro-batch split on purpose, which a pipeline changes (it splits into more micro-batches).
SFT_MODES = tuple(mode for mode in REDUCTION_MODES if mode not in ("prompt_mean", "token_mean_legacy"))
FULL_CASES = tuple(("cross_entropy", mode, "uneven") for mode in SFT_MODES) + (
    ("ppo", "prompt_mean", "rl"),
    ("gspo", "sequence_mean", "rl"),
)
WIDE_CASES = (
    ("cross_entropy", "token_mean", "uneven"),
    ("cross_entropy", "sum", "uneven"),
    ("ppo", "prompt_mean", "rl"),
)
STEP_CASE = ("cross_entropy", "token_mean", "uneven")
# MoE layouts (the model of moe_model_args; a seventh entry is the expert parallel degree) and
# router-loss cases (moe_cases.ROUTER_CONFIGS).
MOE_LAYOUTS = {
    2: ((2, 1, 1, 1, 1, "1F1B"),),
    4: ((2, 1, 2, 1, 1, "InterleavedZeroBubble"), (2, 1, 1, 1, 2, "1F1B"), (2, 1, 2, 1, 1, "1F1B", 2)),
}
MOE_CASES = ("global_pooled", "sequence_pooled", "global_sum")
# The MoE layout that also replays recorded experts (moe_cases.REPLAY): each MoE layer is a stage
# of its own, on the two pipeline ranks, so each stage picks its layer's column of the record.
MOE_REPLAY_LAYOUT = (2, 1, 2, 1, 1, "InterleavedZeroBubble")
# Vision-language layouts (the model of vlm_model_args, the batch of vlm_cases: images of uneven
# counts and sizes, a DP rank without any): every VLM mode, then a clipped AdamW step.
VLM_LAYOUTS = {2: ((2, 1, 1, 1, 1, "1F1B"),), 4: ((2, 1, 1, 1, 2, "1F1B"), (2, 1, 2, 1, 1, "Interleaved1F1B"))}
VLM_BUDGET = (24, 16)  # tokens, vision patches
VLM_CASES = (("token_mean", False), ("sequence_mean", False), ("token_mean", True))
# The world size whose launch checks a checkpoint across pipeline splits and degrees.
CHECKPOINT_WORLD = 4
# The layout that also trains adapters (lora_cases.SETTINGS) and exports them: (world size, layout).
LORA_LAYOUT = (4, (2, 1, 2, 1, 1, "1F1B"))


def model_args():
    return dataclasses.replace(lc.model_args(), n_layers=NUM_LAYERS)


def options(mode: str, max_norm: float = 0.0, min_microbatches: int = 1) -> EngineOptions:
    """The engine's options for a case (the reference's too, with one micro-batch minimum)."""
    return EngineOptions(
        reduction=mode,
        horizon=lc.HORIZON,
        max_tokens_per_microbatch=BUDGET,
        logits_chunk_size=16,
        max_norm=max_norm,
        min_microbatches=min_microbatches,
    )


def layout_name(pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, schedule: str, ep: int = 1) -> str:
    return f"pp{pp}_rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}" + (f"_ep{ep}" if ep > 1 else "") + f"_{schedule}"


def case_key(layout: str, loss_fn: str, mode: str) -> str:
    return f"pipeline/{layout}/{loss_fn}/{mode}"


def _share(samples: list, dims: ParallelDims) -> list:
    n = len(samples) // dims.batch_degree
    return samples[dims.batch_rank() * n : (dims.batch_rank() + 1) * n]


def _whole(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every stage's ``{name: full tensor}`` merged, on every rank (collective when launched)."""
    mine = {name: lc.full(t) for name, t in tensors.items()}
    if not dist.is_initialized():
        return mine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {name: t for held in everyone for name, t in held.items()}


def record(engine, fb, metrics: MetricsLogger, step: bool) -> dict:
    """What a case leaves: the whole gradient, what the metrics logger logs (a window of one
    second whose tokens are the loss tokens) and, after a ``step`` (a clipped AdamW step), the
    weights; without one the gradient is cleared. Pipelined or not (the references)."""
    model, pp_mesh = engine.model, engine.parallel_dims.mesh("pp")
    grads = _whole({fqn: p.grad for fqn, p in model.named_parameters() if p.grad is not None})
    if step:
        optim = engine.optim_step()
    else:
        optim = {"grad_norm": clip_grad_norm_(list(model.parameters()), 0.0, pp_mesh), "lr": lc.LR}
        model.zero_grad(set_to_none=True)
    logged = metrics.log(
        1,
        fb=fb,
        optim=optim,
        window_tokens=fb.counts[NUM_LOSS_TOKENS],
        window_squared_lens=fb.counts[NUM_LOSS_TOKENS],
        window_seconds=1.0,
        data_stats={},
    )
    entry = {"grads": grads, "logged": logged}
    if step:
        entry["params"] = _whole(dict(model.named_parameters()))
    return entry


def moe_model_args():
    """A MoE model whose first two layers are dense: under pp2 the first stage routes nothing."""
    return dataclasses.replace(moe_cases.model_args(), n_layers=4, mlp_only_layers=(0, 1))


def moe_options(name: str) -> EngineOptions:
    """The options of a MoE case: its router losses, routing replay on for moe_cases.REPLAY."""
    replay = name == moe_cases.REPLAY
    config = moe_cases.REPLAY_CONFIG if replay else moe_cases.ROUTER_CONFIGS[name]
    return dataclasses.replace(options("token_mean"), router=config, router_replay="rollout" if replay else "off")


def moe_batch(name: str) -> list:
    return moe_cases.replay_batch(moe_model_args()) if name == moe_cases.REPLAY else lc.global_batch("uneven")


def run_pipeline_checks(world_size: int, results: dict) -> None:
    for layout in PIPELINE_LAYOUTS.get(world_size, ()):
        dims, schedule = _dims(world_size, *layout)
        _run_layout(dims, schedule, results)
        if (world_size, layout) == LORA_LAYOUT:
            _run_layout(dims, schedule, results, lora=True)
    if world_size == CHECKPOINT_WORLD:
        _run_checkpoint_across_splits(world_size, results)
    for layout in VLM_LAYOUTS.get(world_size, ()):
        dims, schedule = _dims(world_size, *layout)
        _run_vlm_layout(dims, schedule, results)
    for layout in MOE_LAYOUTS.get(world_size, ()):
        dims, schedule = _dims(world_size, *layout)
        _run_moe_layout(dims, schedule, results)


def _run_checkpoint_across_splits(world_size: int, results: dict) -> None:
    """A training checkpoint (weights and AdamW moments, through the checkpoint module's own
    stateful wrappers) of pp2 x dp2 split 6 + 2 after a clipped step, loaded by pp2 x dp2 under
    Interleaved1F1B (4 stages of 2 layers, two per rank) and by dp4 without pipeline."""
    box = [tempfile.mkdtemp(prefix="pp_checkpoints_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    path = os.path.join(box[0], "step")
    source, _ = _dims(world_size, 2, 1, 2, 1, 1, "1F1B")
    plan = plan_pipeline(NUM_LAYERS, 2, source.mesh("pp").get_local_rank(), "1F1B", layers_per_stage=6)
    model, optimizer = _trainable(source, plan)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    engine = PipelineEngine(
        model,
        pipeline=plan,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        parallel_dims=source,
        device=torch.device("cpu"),
        options=options("token_mean", lc.MAX_NORM, min_microbatches=plan.num_stages),
    )
    engine.forward_backward(_share(lc.global_batch("uneven"), source))
    engine.optim_step()
    dcp.save(_training_state(model, optimizer), checkpoint_id=path)
    results["pipeline/checkpoint/trained"] = _snapshot(model, optimizer)
    interleaved, _ = _dims(world_size, 2, 1, 2, 1, 1, "Interleaved1F1B")
    targets = {
        "interleaved": (
            interleaved,
            plan_pipeline(NUM_LAYERS, 2, interleaved.mesh("pp").get_local_rank(), "Interleaved1F1B"),
        ),
        "dp4": (_dims(world_size, 1, 1, 4, 1, 1, "1F1B")[0], None),
    }
    for name, (dims, target_plan) in targets.items():
        model, optimizer = _trainable(dims, target_plan, seed=lc.SEED + 1)
        dcp.load(_training_state(model, optimizer), checkpoint_id=path)
        results[f"pipeline/checkpoint/{name}"] = _snapshot(model, optimizer)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0])


def _trainable(dims: ParallelDims, plan, seed: int = lc.SEED):
    """The deeper layout model (pipelined by ``plan``, if any) and its AdamW."""
    model = build_model(
        model_args(),
        parallel_dims=dims,
        device=torch.device("cpu"),
        seed=seed,
        param_dtype=torch.float32,
        pipeline=plan,
    )
    return model, build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)


def _training_state(model, optimizer) -> dict:
    return {"model": _ModelState(model), "optimizer": _OptimizerState(model, optimizer)}


def _snapshot(model, optimizer) -> dict:
    """Every stage's whole weights and AdamW moments."""
    moments = {
        f"{fqn}/{name}": value
        for fqn, param in model.named_parameters()
        for name, value in optimizer.state[param].items()
        if name != "step"
    }
    return {"params": _whole(dict(model.named_parameters())), "optimizer": _whole(moments)}


def vlm_model_args():
    return dataclasses.replace(vlm_cases.model_args(), n_layers=4)


def vlm_options(mode: str, max_norm: float = 0.0) -> EngineOptions:
    return dataclasses.replace(
        options(mode, max_norm),
        max_tokens_per_microbatch=VLM_BUDGET[0],
        max_patches_per_microbatch=VLM_BUDGET[1],
        vision=VisionPacking(vlm_cases.PATCH_DIM, vlm_cases.MERGE),
    )


def _run_vlm_layout(dims: ParallelDims, schedule: str, results: dict) -> None:
    """The first stage encodes the images: every VLM mode's gradients and logged values, then a step."""
    device = torch.device("cpu")
    plan = plan_pipeline(4, dims.pp, dims.mesh("pp").get_local_rank(), schedule)
    model = build_model(
        vlm_model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32, pipeline=plan
    )
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    layout = layout_name(dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, schedule)
    metrics = MetricsLogger(dims, device, dist.get_rank(), tb_folder=None, num_params=1, flops_per_token_context=1)
    for mode, step in VLM_CASES:
        engine = PipelineEngine(
            model,
            pipeline=plan,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            parallel_dims=dims,
            device=device,
            options=dataclasses.replace(
                vlm_options(mode, lc.MAX_NORM if step else 0.0), min_microbatches=plan.num_stages
            ),
        )
        fb = engine.forward_backward(_share(vlm_cases.global_batch(), dims))
        results[f"pipeline/vlm/{layout}/{mode}" + ("/step" if step else "")] = record(engine, fb, metrics, step)


def _dims(world_size: int, pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, schedule: str, ep: int = 1):
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, world_size=world_size, pp=pp, ep=ep)
    dims.build_meshes("cpu")
    return dims, schedule


def _run_moe_layout(dims: ParallelDims, schedule: str, results: dict) -> None:
    """The router losses of every MoE case: gradients and logged values (moe/* included)."""
    device = torch.device("cpu")
    plan = plan_pipeline(4, dims.pp, dims.mesh("pp").get_local_rank(), schedule)
    model = build_model(
        moe_model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32, pipeline=plan
    )
    moe_cases.set_router_weights(model)
    layout = layout_name(dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, schedule, dims.ep)
    metrics = MetricsLogger(dims, device, dist.get_rank(), tb_folder=None, num_params=1, flops_per_token_context=1)
    replay = (moe_cases.REPLAY,) if layout == layout_name(*MOE_REPLAY_LAYOUT) else ()
    for name in (*MOE_CASES, *replay):
        engine = PipelineEngine(
            model,
            pipeline=plan,
            optimizer=None,
            lr_scheduler=None,
            parallel_dims=dims,
            device=device,
            options=dataclasses.replace(moe_options(name), min_microbatches=plan.num_stages),
        )
        fb = engine.forward_backward(_share(moe_batch(name), dims))
        results[f"pipeline/moe/{layout}/{name}"] = record(engine, fb, metrics, step=False)


def _run_layout(dims: ParallelDims, schedule: str, results: dict, lora: bool = False) -> None:
    device = torch.device("cpu")
    plan = plan_pipeline(NUM_LAYERS, dims.pp, dims.mesh("pp").get_local_rank(), schedule)
    model = build_model(
        model_args(),
        parallel_dims=dims,
        device=device,
        seed=lc.SEED,
        param_dtype=torch.float32,
        pipeline=plan,
        lora=lora_cases.SETTINGS if lora else None,
    )
    layout = layout_name(dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, schedule) + (
        "_lora" if lora else ""
    )
    if lora:
        lora_cases.set_adapters(model)
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    metrics = MetricsLogger(dims, device, dist.get_rank(), tb_folder=None, num_params=1, flops_per_token_context=1)

    def engine(mode: str, max_norm: float = 0.0) -> PipelineEngine:
        return PipelineEngine(
            model,
            pipeline=plan,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            parallel_dims=dims,
            device=device,
            options=options(mode, max_norm, min_microbatches=plan.num_stages),
        )

    out = engine("token_mean").forward(_share(lc.global_batch("uneven"), dims), with_entropy=True)
    results[f"pipeline/{layout}/forward"] = {
        "logprobs": out.logprobs,
        "entropies": out.entropies,
        "rank": dims.batch_rank(),
    }
    cases = () if lora else FULL_CASES if dist.get_world_size() == 2 else WIDE_CASES
    for index, (loss_fn, mode, data) in enumerate((*cases, STEP_CASE)):
        step = index == len(cases)
        run = engine(mode, lc.MAX_NORM if step else 0.0)
        fb = run.forward_backward(_share(lc.global_batch(data), dims), loss_fn, lc.RL_LOSS_FNS.get(loss_fn))
        results[case_key(layout, loss_fn, mode) + ("/step" if step else "")] = record(run, fb, metrics, step)
    if lora:
        results[f"pipeline/{layout}/exports"] = _exports(model)


def _exports(model) -> dict[str, dict[str, torch.Tensor]]:
    """The PEFT adapter and the merged Hugging Face model the pipeline's stages export together."""
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    folder = Path(box[0])
    save_peft_adapter(model, str(folder / "adapter"), lora_cases.SETTINGS, torch.float32)
    save_merged_hf(model, str(folder / "merged"), torch.float32)
    exported = {
        name: {key: t for file in sorted((folder / name).glob("*.safetensors")) for key, t in load_file(file).items()}
        for name in ("adapter", "merged")
    }
    exported["num_merged_files"] = len(list((folder / "merged").glob("*.safetensors")))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder)
    return exported
