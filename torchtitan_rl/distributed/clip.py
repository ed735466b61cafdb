"""Gradient clipping by the global norm over plain and sharded (DTensor) gradients."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip in place when ``max_norm > 0``; returns the pre-clip global norm (on device).

    The norm of sharded gradients is a partial DTensor; ``full_tensor`` reduces it over the
    shards, so every rank gets the norm of the whole gradient.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=True)
    return total_norm
