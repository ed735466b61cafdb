"""AdamW and the warmup + decay learning-rate schedule."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach")


def build_optimizer(
    model: nn.Module,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    implementation: str = "auto",
) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (frozen ones get no state), one parameter group
    per device mesh: multi-tensor kernels cannot mix plain tensors and DTensors of different
    meshes (a VLM's vision tower is replicated over tensor parallel, its language model is not).

    ``implementation``: ``fused`` (one kernel per parameter group) or ``foreach`` (multi-tensor
    ops); ``auto`` is fused, which torch has for CPU and CUDA tensors and DTensors, equals
    foreach up to float rounding (figures: docs/benchmarks/optimizer.md).
    """
    if implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(
            f"optimizer.implementation: {implementation!r} is not one of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}"
        )
    groups: dict[object, list[nn.Parameter]] = {}
    for param in model.parameters():
        if param.requires_grad:
            groups.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    kernel = "foreach" if implementation == "foreach" else "fused"
    return torch.optim.AdamW(
        [{"params": params} for params in groups.values()],
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=weight_decay,
        **{kernel: True},
    )


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the base lr for optimizer step ``step`` (1-based).

    Linear warmup over ``warmup_steps`` steps (1/(w+1) ... w/(w+1)), the full lr at the
    first step after warmup, then linear or cosine decay reaching ``min_lr_factor`` at the
    last step.
    """
    if step <= warmup_steps:
        return step / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps - 1) / max(1, total_steps - warmup_steps - 1))
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr_scheduler.decay_type {decay_type!r}; valid: linear, cosine")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, decay_type: str, min_lr_factor: float
):
    # LambdaLR evaluates the factor for its internal counter, which starts at 0 for the
    # first optimizer step; our schedule is written in 1-based steps.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: lr_factor(i + 1, total_steps, warmup_steps, decay_type, min_lr_factor)
    )
