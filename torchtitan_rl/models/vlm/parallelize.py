"""Apply parallelism to a vision-language model from outside (docs/design.md, 'Vision-language model').

The language model is parallelized exactly as a Qwen3 model. The vision tower and projector
are small, so tensor parallel replicates them: every TP rank encodes all images of the
micro-batch, and only the feature rows of its own sequence-parallel token shard enter its
residual stream. Each rank's feature gradient then holds its tokens' share only; summing it
over ``tp`` on the way back makes the vision gradients whole and equal on every TP rank, so
the clipping norm counts them once. FSDP shards each vision block and the projector like an
LM block; context parallel needs nothing here (pixels are not split, ``vision_index`` is).
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.models.qwen3.parallelize import parallelize_qwen3
from torchtitan_rl.models.vlm.model import merge_vision_features


def parallelize_vlm(model: nn.Module, parallel_dims: ParallelDims, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    tp_mesh = parallel_dims.mesh("tp")
    if tp_mesh is not None:
        model.merge_vision_features = tp_merge_vision_features(tp_mesh)
    vision_units = [*model.vision_tower.layers.values(), model.projector]
    parallelize_qwen3(model, parallel_dims, param_dtype, reduce_dtype, extra_fsdp_units=vision_units)


def tp_merge_vision_features(tp_mesh: DeviceMesh):
    """``merge_vision_features`` for a residual stream sharded over ``tp`` by tokens (the model
    passes this rank's share of ``vision_index``, see ``Qwen3Model.shard_tokens``)."""

    def merge(h: torch.Tensor, features: torch.Tensor, vision_index: torch.Tensor) -> torch.Tensor:
        return merge_vision_features(h, _SumGradOverTP.apply(features, tp_mesh), vision_index)

    return merge


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP ranks (Megatron's "copy to
    tensor-parallel region")."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
        ctx.tp_mesh = tp_mesh
        return features.view_as(features)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce(grad.contiguous(), "sum", ctx.tp_mesh), None
