"""Layout-independent weight initialization for models built on the meta device."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def init_weights_layout_invariant(model: nn.Module, seed: int, init_param_, param_seed) -> None:
    """Give every parameter the values a single-device init with ``seed`` would give.

    Each parameter is generated whole on its device from its own generator (seeded from
    ``seed`` and its name, see ``param_seed``) and each rank keeps its shard, so the
    weights depend neither on the number of ranks nor on how they are sharded.
    """
    for fqn, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        generator = torch.Generator(device=local.device).manual_seed(param_seed(seed, fqn))
        full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
        init_param_(fqn, full, generator)
        if isinstance(param, DTensor):
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.copy_(full)
