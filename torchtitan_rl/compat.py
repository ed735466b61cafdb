"""The one place for differences between the torch versions we support.

GPU images ship torch 2.11, CPU machines 2.13; code elsewhere calls these wrappers.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# Newer releases renamed the dim-0 gathers and deprecated the old names.
_all_gather_dim0_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_all_gather_dim0 = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_gather_autograd(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; backward reduce-scatters (sums)."""
    return _all_gather_dim0_autograd(tensor.contiguous(), 0, mesh)


def all_gather(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, without autograd; waits for the result."""
    out = _all_gather_dim0(tensor.contiguous(), 0, mesh)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def local_shard_bounds(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset in the full tensor) of this rank's block of ``tensor``; a plain tensor is all local.

    Private DTensor helper (the one torch.distributed.checkpoint uses to place shards), with the
    same (shape, mesh, placements) signature in 2.11 and 2.13. It handles the FSDP2-over-TP
    ``_StridedShard`` placements; every layout of ``parallelize_qwen3`` keeps a rank's block
    contiguous, which tests/distributed/test_hf_load.py checks against ``full_tensor()``.
    """
    if not isinstance(tensor, DTensor):
        return tuple(tensor.shape), (0,) * tensor.dim()
    return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)


def launch_store() -> dist.Store:
    """The key-value store the launch's default process group was built on (torchrun's).

    Private c10d helper, with the same signature in 2.11 and 2.13; ``clone()`` of the store it
    returns opens another connection to the same keys.
    """
    return dist.distributed_c10d._get_default_store()
