"""The one place for differences between the torch versions we support.

GPU images ship torch 2.11, CPU machines 2.13; code elsewhere calls these wrappers.
"""

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

if hasattr(funcol, "all_gather_single_autograd"):
    _all_gather_dim0 = funcol.all_gather_single_autograd
else:  # older releases only have the now-deprecated name
    _all_gather_dim0 = funcol.all_gather_tensor_autograd


def all_gather_autograd(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0; backward reduce-scatters (sums)."""
    return _all_gather_dim0(tensor.contiguous(), 0, mesh)
