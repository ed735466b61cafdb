"""Apply parallelism to a Qwen3 model from outside (torchtitan's model/parallelize split)."""

import torch
from torch import nn

from torchtitan_rl.distributed.fsdp import apply_fsdp
from torchtitan_rl.distributed.parallel_dims import ParallelDims


def parallelize_qwen3(model: nn.Module, parallel_dims: ParallelDims, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """FSDP2 per transformer block and at the root, when there is more than one DP rank."""
    mesh = parallel_dims.fsdp_mesh()
    if mesh is None:
        return
    apply_fsdp(model, list(model.layers.values()), mesh, param_dtype, reduce_dtype)
