"""Apply parallelism to a vision-language model from outside (docs/design.md, 'Vision-language model').

The language model is parallelized exactly as a Qwen3 model. The vision tower and projector
are small, so tensor parallel replicates them: every TP rank encodes all images of the
micro-batch, and only the feature rows of its own sequence-parallel token shard enter its
residual stream. Each rank's feature gradient then holds its tokens' share only; summing it
over ``tp`` on the way back (``TokenShard.replicated``, declared by the TP step of
``parallelize_qwen3``) makes the vision gradients whole and equal on every TP rank, so the
clipping norm counts them once. FSDP shards each vision block and the projector like an
LM block; context parallel needs nothing here (pixels are not split, ``vision_index`` is).
"""

import torch
from torch import nn

from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.qwen3.parallelize import parallelize_qwen3


def parallelize_vlm(
    model: nn.Module,
    parallel_dims: ParallelDims,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    *,
    reshard_after_forward: str = "default",
) -> None:
    # The vision units run before the decoder, so under the "default" reshard policy they are
    # never the last block of the forward.
    # A pipeline stage after the first has neither (models.stages).
    vision_units = [] if model.vision_tower is None else [*model.vision_tower.layers.values(), model.projector]
    parallelize_qwen3(
        model,
        parallel_dims,
        param_dtype,
        reduce_dtype,
        extra_fsdp_units=vision_units,
        reshard_after_forward=reshard_after_forward,
    )
