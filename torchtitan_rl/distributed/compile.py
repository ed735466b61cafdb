"""Per-block ``torch.compile``, applied from outside the model.

Like activation checkpointing it keeps the module tree (no ``OptimizedModule`` wrapper), so
parameter names, init seeds, checkpoints and FSDP2 hooks are the same with or without it:
each block's ``forward`` is replaced on the instance by its compiled version. The blocks
share one code object, so dynamo compiles it once for all of them.

Two things would otherwise recompile every micro-batch:

* the packed token count T changes from one micro-batch to the next: the first dimension
  (the tokens) of every tensor a block receives is marked dynamic before the call. The graphs
  that resume after the attention call take tensors made inside the block: dynamo makes their
  token dimension dynamic when it recompiles them for a second length (at most two compiles
  per graph). ``dynamic=True`` would avoid that at twice the trace time, with every hidden
  size symbolic too;
* the attention a block receives is a per-forward Python object (its mask data):
  ``packed_attention`` is excluded from compilation (``torch.compiler.disable``), so the graph
  breaks around it and nothing guards on the mask data.

Under tensor parallel the first block's input is the embedding's asynchronous reduce-scatter,
an ``AsyncCollectiveTensor``. AOT autograd traces its inner tensor and returns that tensor's
gradient as a plain tensor to the collective's DTensor backward, which then fails; a copy
made before the call waits for the collective and keeps the autograd chain intact.

Modules that cannot be traced opt out themselves with ``torch.compiler.disable`` (the
attention call above, MoE experts): the compiled block runs them eagerly.
"""

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._pytree import tree_map


def apply_compile(blocks: list[nn.Module], backend="inductor") -> None:
    """Compile each block's forward with ``backend`` (anything ``torch.compile`` takes),
    dynamic in the token dimension.

    Apply before activation checkpointing, which then recomputes the compiled forward."""
    for block in blocks:
        block.forward = _tokens_dynamic(torch.compile(block.forward, backend=backend))


def _tokens_dynamic(compiled_forward):
    def prepare(leaf):
        if isinstance(leaf, AsyncCollectiveTensor):
            leaf = leaf.clone()  # a plain tensor (see the module docstring)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            # maybe_: where the graph does specialize the size (0 or 1 tokens) it recompiles
            # instead of raising.
            torch._dynamo.maybe_mark_dynamic(leaf, 0)
        return leaf

    def forward(*args):
        return compiled_forward(*tree_map(prepare, args))

    return forward
