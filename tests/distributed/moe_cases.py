"""Mixture-of-experts layouts inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``MOE_LAYOUTS`` a tiny Qwen3-MoE (dense first layer, then MoE layers) runs
``forward_backward`` with the router losses on: the global and sequence scopes of the
load-balancing loss (pooled and summed over layers) with the z-loss, at a budget that gives
several micro-batches per rank (and a filler micro-batch on some ranks), and an aux-only
objective (the router losses' gradient must not scale with the CP / TP degree).
Rank 0 records gradients and logged numbers for test_moe_layout.py.
"""

import dataclasses

import torch
import torch.distributed as dist

import layout_cases as lc
import lora_cases
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.router import RouterLossConfig
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.lora import LoRASettings
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model

# (dp_replicate, dp_shard, cp, tp): dp 2, cp 2, tp 2, dp2 x cp2, cp2 x tp2 (and one rank).
MOE_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 2, 1), (1, 1, 2, 2))
# Budget 40: the "uneven" batch packs into 3 micro-batches on one rank, and dp 2's ranks get
# 2 and 1, so one of them runs a filler micro-batch.
BUDGET = 40
ROUTER_CONFIGS = {
    "global_pooled": RouterLossConfig(
        aux_loss_coef=0.3, aux_loss_scope="global", aux_loss_layers="pooled", z_loss_coef=0.01
    ),
    "global_sum": RouterLossConfig(aux_loss_coef=0.3, aux_loss_scope="global", aux_loss_layers="sum"),
    "sequence_pooled": RouterLossConfig(
        aux_loss_coef=0.3, aux_loss_scope="sequence", aux_loss_layers="pooled", z_loss_coef=0.01
    ),
}
# The aux-only objective: the token loss contributes nothing (no loss tokens), so the gradient
# is the router loss's alone.
AUX_ONLY = "aux_only"
AUX_ONLY_CONFIG = RouterLossConfig(aux_loss_coef=1.0)
MICROBATCH = "microbatch_pooled"
MICROBATCH_CONFIG = RouterLossConfig(aux_loss_coef=0.3, aux_loss_scope="microbatch", aux_loss_layers="pooled")
# The global_pooled case on a model whose attention and dense MLP carry LoRA adapters (the
# experts are not adapted): only the adapters train, the router losses still count.
LORA = "lora_global_pooled"
LORA_SETTINGS = LoRASettings(rank=2, alpha=4.0, target_modules=("wq", "wo", "w1", "w2"))
ROUTER_STD = 1.0  # HF's init std of 0.02 leaves top-k near-ties that float noise flips


def model_args() -> Qwen3ModelArgs:
    return dataclasses.replace(
        lc.model_args(False),
        n_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_hidden_dim=16,
        mlp_only_layers=(0,),
        experts_impl="grouped_mm",
    )


@torch.no_grad()
def set_router_weights(model: torch.nn.Module) -> None:
    """Router weights drawn with std ROUTER_STD from a fixed seed, identical for every layout."""
    for fqn, param in model.named_parameters():
        if fqn.endswith("router.weight"):
            layer = int(fqn.split("layers.")[1].split(".")[0])
            full = ROUTER_STD * torch.randn(param.shape, generator=torch.Generator().manual_seed(100 + layer))
            lc.set_full_(param, full)


def case_key(layout: tuple, name: str) -> str:
    return "moe/rep{}_shard{}_cp{}_tp{}".format(*layout) + f"/{name}"


def run_moe_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in MOE_LAYOUTS:
        return
    device = torch.device("cpu")
    model = build_model(model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32)
    set_router_weights(model)
    lora_model = build_model(
        model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32, lora=LORA_SETTINGS
    )
    set_router_weights(lora_model)
    lora_cases.set_adapters(lora_model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    metrics = MetricsLogger(dims, device, rank, tb_folder=None, num_params=1, flops_per_token_context=1)
    share = lc.GLOBAL_BATCH_SIZE // dims.batch_degree
    cases = [(name, config, "uneven", model) for name, config in ROUTER_CONFIGS.items()]
    cases.append((AUX_ONLY, AUX_ONLY_CONFIG, "no_loss", model))
    cases.append((LORA, ROUTER_CONFIGS["global_pooled"], "uneven", lora_model))
    if dims.batch_degree == 1:
        # Layout-dependent on purpose, but exact for a given micro-batch plan (here the same
        # 3 micro-batches on every layout without data parallel), whatever CP / TP split them.
        cases.append((MICROBATCH, MICROBATCH_CONFIG, "uneven", model))
    for name, config, variant, model in cases:
        optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
        scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
        options = EngineOptions(
            reduction="token_mean",
            horizon=lc.HORIZON,
            max_tokens_per_microbatch=BUDGET,
            logits_chunk_size=16,
            max_norm=0.0,
            router=config,
        )
        engine = Engine(
            model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
        )
        samples = lc.global_batch(variant)[dims.batch_rank() * share : (dims.batch_rank() + 1) * share]
        fb = engine.forward_backward(samples)
        grads = {fqn: lc.full(p.grad) for fqn, p in model.named_parameters() if p.requires_grad}
        optim = {"grad_norm": clip_grad_norm_(list(model.parameters()), 0.0), "lr": lc.LR}
        model.zero_grad(set_to_none=True)
        logged = metrics.log(
            1,
            fb=fb,
            optim=optim,
            window_tokens=fb.counts[0],
            window_squared_lens=fb.counts[0],
            window_seconds=1.0,
            data_stats={},
        )
        results[case_key(layout, name)] = {"grads": grads, "logged": logged}
