"""FSDP2 application with summed (never averaged) gradient reduction."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_fsdp(
    model: nn.Module | None,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> None:
    """Shard each block and the root ``model`` (None: blocks only) over ``mesh`` (2-D mesh =
    HSDP), then make every group SUM."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=True)
    if model is not None:
        # The root keeps its parameters (embeddings, final norm, output head) gathered after
        # forward: the loss applies the output head outside model.forward, in chunks.
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    for module in [model] if model is not None else blocks:
        enable_sum_reduction(module)


def enable_sum_reduction(model: nn.Module) -> None:
    """Make every FSDP group sum gradients over its ranks instead of averaging them.

    The setters are per module, not recursive, hence the walk. The forced sum also keeps
    gloo working: it has no PREMUL_SUM for a pre-divided reduction.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
