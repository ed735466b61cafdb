"""FSDP2 application with summed (never averaged) gradient reduction."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# parallelism.fsdp_reshard_after_forward (torchtitan's names and meaning).
RESHARD_POLICIES = ("default", "always", "never")


def reshards_after_forward(policy: str, runs_last: bool) -> bool:
    """Whether a block frees its gathered parameters after its forward under ``policy``.

    ``runs_last``: the block is the last to run forward, so its backward follows at once;
    "default" keeps it gathered, which spares the all-gather that backward would otherwise
    start with (one fewer per micro-batch), while every other block frees its memory.
    """
    assert policy in RESHARD_POLICIES, policy
    return policy == "always" or (policy == "default" and not runs_last)


def apply_fsdp(
    model: nn.Module | None,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    *,
    reshard_after_forward: str,
    last_runs_last: bool = True,
) -> None:
    """Shard each block and the root ``model`` (None: blocks only) over ``mesh`` (2-D mesh =
    HSDP), then make every group SUM.

    ``blocks`` are in forward order; ``reshard_after_forward`` is a policy of
    ``RESHARD_POLICIES`` (see ``reshards_after_forward``). ``last_runs_last``: the last of
    ``blocks`` is the last block of the whole forward (False for a group, such as MoE experts,
    whose last member may sit in an earlier block).
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for i, block in enumerate(blocks):
        runs_last = last_runs_last and i == len(blocks) - 1
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshards_after_forward(reshard_after_forward, runs_last),
        )
    if model is not None:
        # Whatever the policy, the root keeps its own parameters (embeddings, final norm,
        # output head) gathered after forward: the loss applies the output head outside
        # model.forward, in chunks, so resharding at the end of forward would gather the head
        # again right away. A forward without backward must therefore reshard by itself
        # (``reshard``).
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    for module in [model] if model is not None else blocks:
        enable_sum_reduction(module)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP group of ``model`` (``FSDPModule.reshard``
    is not recursive) and register the sharded ones again.

    Backward reshards each group; after a forward without backward, the groups that did not
    reshard after forward (the root, and blocks under the "default" and "never" policies) would
    otherwise keep gathered copies that the next optimizer step leaves stale.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def enable_sum_reduction(model: nn.Module) -> None:
    """Make every FSDP group sum gradients over its ranks instead of averaging them.

    The setters are per module, not recursive, hence the walk. The forced sum also keeps
    gloo working: it has no PREMUL_SUM for a pre-divided reduction.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
