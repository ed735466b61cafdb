"""Tensor-parallel styles for linear layers that may carry LoRA adapters.

An adapter follows its base layer's plan, so that ``B A x`` comes out in the base output's
layout without a collective of its own:

- column-parallel base (weight sharded on the output features): A replicated, B sharded on
  the output features. Every rank computes ``A x`` whole (x is replicated), then its own
  output columns of ``B A x``.
- row-parallel base (weight sharded on the input features): A sharded on the input
  features, B replicated. ``A x`` is a partial sum over the ranks like the base output, and
  B maps it to a partial output that the base layer's reduction sums with the base's.

The gradient of a replicated factor is summed over the TP ranks by DTensor's backward, as a
norm weight's is. ``colwise`` / ``rowwise`` return torch's own styles for a plain linear layer.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan_rl.models.lora import LoRALinear


def colwise(module: nn.Module, *, output_layouts: Placement | None = None) -> ParallelStyle:
    """Column-parallel style for ``module``: torch's ``ColwiseParallel``, or its LoRA form;
    the output stays sharded on the features unless ``output_layouts`` says otherwise."""
    output_layouts = output_layouts or Shard(-1)
    if isinstance(module, LoRALinear):
        return _LoRAParallel(
            weight=Shard(0), lora_a=Replicate(), lora_b=Shard(0), input_layout=Replicate(), output_layout=output_layouts
        )
    return ColwiseParallel(output_layouts=output_layouts)


def rowwise(module: nn.Module, *, output_layouts: Placement | None = None) -> ParallelStyle:
    """Row-parallel style for ``module``: torch's ``RowwiseParallel``, or its LoRA form; the
    partial output is summed into ``output_layouts`` (default: replicated)."""
    output_layouts = output_layouts or Replicate()
    if isinstance(module, LoRALinear):
        return _LoRAParallel(
            weight=Shard(1), lora_a=Shard(1), lora_b=Replicate(), input_layout=Shard(-1), output_layout=output_layouts
        )
    return RowwiseParallel(output_layouts=output_layouts)


class _LoRAParallel(ParallelStyle):
    """A ``LoRALinear`` with its base weight, A and B placed as given; its input arrives as a
    local tensor of ``input_layout`` and leaves as a local tensor of ``output_layout``."""

    def __init__(
        self,
        *,
        weight: Placement,
        lora_a: Placement,
        lora_b: Placement,
        input_layout: Placement,
        output_layout: Placement,
    ):
        self.placements = {"": weight, "lora_a": lora_a, "lora_b": lora_b}
        self.input_layout, self.output_layout = input_layout, output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, LoRALinear), type(module)
        assert module.bias is None, "a tensor-parallel LoRA layer has no bias"
        return distribute_module(module, device_mesh, self._partition, self._prepare_input, self._prepare_output)

    def _partition(self, name: str, submodule: nn.Module, device_mesh: DeviceMesh) -> None:
        placement = self.placements[name]
        weight = submodule.weight
        sharded = distribute_tensor(weight, device_mesh, [placement], src_data_rank=self.src_data_rank)
        submodule.register_parameter("weight", nn.Parameter(sharded, requires_grad=weight.requires_grad))

    def _prepare_input(self, module, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, (self.input_layout,), run_check=False)
        return x

    def _prepare_output(self, module, output, device_mesh):
        if output.placements != (self.output_layout,):
            output = output.redistribute(placements=(self.output_layout,), async_op=True)
        return output.to_local()
