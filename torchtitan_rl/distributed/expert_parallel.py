"""Expert parallel: each rank of an ``ep`` group owns ``num_experts / ep`` experts of every MoE
layer, and tokens travel to their experts' owners and back with all-to-all (docs/design.md,
'Expert parallel').

The model stays single-device code: ``models.moe.GroupedExperts`` takes tokens sorted by
expert with the count per expert, and computes with whatever block of the stacked weights it
holds. ``ExpertParallel`` shards that stack over ``ep`` (``Shard(0)``: rank ``p`` owns experts
``[p E/ep, (p+1) E/ep)``) and wraps the module's call:

* dispatch: the per-expert counts are exchanged first (the receivers need them to size their
  buffers), then the tokens, with an ``all_to_all_single`` whose backward sends the gradient
  back; the received rows
  come grouped by sender, and are re-sorted by local expert (senders in rank order within an
  expert) for the grouped kernel;
* combine: the outputs are put back in the received order and sent home with the reverse
  all-to-all, so the caller gets them in its own order and weights them as without EP.

Routing and router statistics happen before dispatch, on the caller's own tokens, so router
losses do not change. Backward runs the two all-to-alls in reverse: an expert's weight
gradient sums the tokens of every rank of its group, and FSDP (over ``expert_fsdp``) sums it
over the groups.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ExpertParallel(ParallelStyle):
    """Shard a ``GroupedExperts`` module's ``[E, ...]`` weights over an ``ep`` mesh and move its
    tokens with all-to-all. One instance per module: it keeps the dispatch's layout until the
    combine of the same call."""

    def __init__(self):
        super().__init__()
        self._layout = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, partition_fn=_shard_experts, input_fn=self._dispatch, output_fn=self._combine
        )

    @torch.compiler.disable  # host-side splits: runs eagerly inside a compiled block
    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, tokens_per_expert = inputs
        num_ranks = mesh.size()
        # [destination rank, its local expert] -> [source rank, my local expert].
        sent = tokens_per_expert.view(num_ranks, -1)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent.contiguous(), group=mesh.get_group())
        input_splits = sent.sum(1).tolist()
        output_splits = received.sum(1).tolist()
        rows = _AllToAll.apply(x, output_splits, input_splits, mesh.get_group())
        # Rows arrive grouped by source rank, each group sorted by local expert; the kernel
        # wants them grouped by local expert (a stable sort keeps the sources in rank order).
        num_local = sent.shape[1]
        expert_of_row = torch.arange(num_local, device=x.device).repeat(num_ranks).repeat_interleave(received.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        self._layout = (order, input_splits, output_splits)
        return rows[order], received.sum(0)

    @torch.compiler.disable
    def _combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        assert self._layout is not None, "combine without a dispatch"
        order, input_splits, output_splits = self._layout
        self._layout = None
        rows = out.new_empty(out.shape).index_copy(0, order, out)
        return _AllToAll.apply(rows, input_splits, output_splits, mesh.get_group())


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(param_name, sharded)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of ``x`` with uneven splits; backward sends the
    gradient back along the same routes. Plain c10d: a gloo group whose last collective was a
    functional one was seen to outlive ``destroy_process_group``."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.routes = (input_splits, output_splits, group)
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        input_splits, output_splits, group = ctx.routes
        return _all_to_all(grad, input_splits, output_splits, group), None, None, None


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out
