"""Pipeline parallelism: a model's layers split into stages over the ``pp`` mesh, run by the
schedules of ``torch.distributed.pipelining`` (docs/design.md, 'Pipeline parallel').

The loss of every micro-batch is already its share of the mini-batch loss (weights from global
counts), so the schedules run with ``scale_grads=False`` and the micro-batches' gradients add
up; torch's default would divide them by the number of micro-batches.

Every stage of a pipeline holds the same micro-batches (the pipeline ranks are not data
parallel), so a stage reads what it needs of micro-batch ``i`` (positions, sequence ids, the
first stage its tokens) from the engine, and only hidden states and their gradients travel
between stages: their shape is the same for every micro-batch because the engine pads each one
to the token budget.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from torchtitan_rl.distributed.utils import full_tensor

# parallelism.pipeline_schedule: name -> (torch's class, default stages per rank). The
# multi-stage schedules loop over the stages (rank r holds r, r + pp, ...) except ZBV, whose
# two stages per rank form a V (rank r holds r and 2 pp - 1 - r).
SCHEDULES = {
    "GPipe": (ScheduleGPipe, 1),
    "1F1B": (Schedule1F1B, 1),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2),
}
V_SHAPED = ("ZBVZeroBubble",)
# The keyword argument through which a stage learns which micro-batch it runs.
MICROBATCH_KWARG = "microbatch"


def splits_backward(schedule: str) -> bool:
    """Whether the schedule takes a stage's input gradients and weight gradients in separate
    backward passes (the zero-bubble ones)."""
    return "ZeroBubble" in schedule


def is_multi_stage(schedule: str) -> bool:
    return issubclass(SCHEDULES[schedule][0], PipelineScheduleMulti)


def layer_ranges(num_layers: int, num_stages: int, layers_per_stage: int = 0) -> list[range]:
    """The layers of each stage, in order: ``layers_per_stage`` each (the last stage takes what
    is left), or with 0 as even as possible, the earlier stages taking one more when the layers
    do not divide (the last stage also runs the output head and the loss)."""
    if layers_per_stage:
        bounds = [min(k * layers_per_stage, num_layers) for k in range(num_stages + 1)]
    else:
        base, extra = divmod(num_layers, num_stages)
        bounds = [0]
        for k in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def num_stages_of(num_layers: int, pp: int, schedule: str, layers_per_stage: int) -> int:
    """How many stages a model of ``num_layers`` layers is split into; ValueError naming the
    keys when the split cannot serve the schedule."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelism.pipeline_schedule = {schedule!r} is not one of {', '.join(SCHEDULES)}")
    per_rank = SCHEDULES[schedule][1]
    if not layers_per_stage:
        num_stages = pp * per_rank
    else:
        num_stages = -(-num_layers // layers_per_stage)
        if num_stages % pp or (num_stages // pp != 1) != is_multi_stage(schedule):
            wanted = "one stage per rank" if not is_multi_stage(schedule) else "several stages per rank"
            raise ValueError(
                f"parallelism.pipeline_layers_per_stage = {layers_per_stage} splits the {num_layers} layers into "
                f"{num_stages} stage(s), but parallelism.pipeline_schedule = {schedule!r} over "
                f"parallelism.pipeline_parallel_degree = {pp} ranks runs {wanted}"
                + (f" ({per_rank * pp} stages)" if schedule in V_SHAPED or not is_multi_stage(schedule) else "")
            )
        if schedule in V_SHAPED and num_stages != 2 * pp:
            raise ValueError(
                f"parallelism.pipeline_schedule = {schedule!r} runs exactly 2 stages per rank ({2 * pp} stages), "
                f"but parallelism.pipeline_layers_per_stage = {layers_per_stage} gives {num_stages}"
            )
    if num_stages > num_layers:
        raise ValueError(
            f"the model's {num_layers} layers cannot fill {num_stages} pipeline stages "
            f"(parallelism.pipeline_parallel_degree = {pp}, parallelism.pipeline_schedule = {schedule!r})"
        )
    return num_stages


def num_microbatches_for(schedule: str, count: int, pp: int) -> int:
    """The fewest micro-batches, at least ``count``, that the schedule runs over ``pp`` ranks:
    at least one per rank; for the multi-stage schedules a multiple of their number of rounds
    (``count // pp``), which torch requires."""
    count = max(count, pp)
    if is_multi_stage(schedule):
        while count % max(1, count // pp):
            count += 1
    return count


def stage_ids(schedule: str, pp_rank: int, pp: int, num_stages: int) -> list[int]:
    """The stages rank ``pp_rank`` of the pipeline holds, in the order the schedule takes them."""
    if schedule in V_SHAPED:
        return [pp_rank, num_stages - 1 - pp_rank]
    return list(range(pp_rank, num_stages, pp))


@dataclass(frozen=True)
class PipelinePlan:
    """How a model is split over the pipeline: the schedule, every stage's layers, and the
    stages this rank holds."""

    schedule: str
    layers: tuple[range, ...]  # per stage
    local_stages: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.layers)


def plan_pipeline(num_layers: int, pp: int, pp_rank: int, schedule: str, layers_per_stage: int = 0) -> PipelinePlan:
    num_stages = num_stages_of(num_layers, pp, schedule, layers_per_stage)
    return PipelinePlan(
        schedule,
        tuple(layer_ranges(num_layers, num_stages, layers_per_stage)),
        tuple(stage_ids(schedule, pp_rank, pp, num_stages)),
    )


def attach_microbatch_inputs(
    module: nn.Module,
    inputs_of: Callable[[int, tuple], tuple[tuple, dict]],
    output_of: Callable[[nn.Module, int, Any], torch.Tensor],
) -> None:
    """Let the schedule call ``module`` with only ``microbatch=tensor([i])`` (plus the previous
    stage's activations): ``inputs_of(i, activations)`` gives the call's real arguments and
    ``output_of(module, i, output)`` turns the module's output into the tensor the stage passes
    on. A later call replaces both (the hooks are registered once)."""
    registered = hasattr(module, "_microbatch_inputs")
    module._microbatch_inputs, module._microbatch_output = inputs_of, output_of
    if registered:
        return

    def before(module, args, kwargs):
        module._microbatch_index = int(kwargs.pop(MICROBATCH_KWARG))
        return module._microbatch_inputs(module._microbatch_index, args)

    def after(module, args, output):
        return module._microbatch_output(module, module._microbatch_index, output)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after)


def run_schedule(
    plan: PipelinePlan,
    stages: dict[int, nn.Module],
    pp_mesh: DeviceMesh,
    device: torch.device,
    *,
    num_microbatches: int,
    activation: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    backward: bool,
) -> None:
    """Run ``num_microbatches`` micro-batches through this rank's ``stages`` (stage id ->
    module, each set up by ``attach_microbatch_inputs``). ``activation``: a tensor of the shape
    and dtype stages send each other (meta is enough). ``loss_fn(hidden, index)`` runs on the
    last stage for micro-batch ``index`` (a one-element CPU tensor) and returns the loss whose
    backward the schedule runs; ``backward`` False only runs forward."""
    if not backward and plan.schedule in V_SHAPED:
        # torch's ZBV schedule has no forward-only mode.
        _forward_in_order(plan, stages, pp_mesh, num_microbatches, activation, loss_fn)
        return
    schedule_cls = SCHEDULES[plan.schedule][0]
    # Requiring grad: the stages exchange gradients of these activations too.
    meta = activation.to("meta").requires_grad_()
    pipeline_stages = [
        PipelineStage(
            module,
            stage_id,
            plan.num_stages,
            device,
            input_args=() if stage_id == 0 else (meta,),
            output_args=(meta,),
            group=pp_mesh.get_group(),
        )
        for stage_id, module in stages.items()
    ]
    kwargs: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
    if is_multi_stage(plan.schedule):
        runner = schedule_cls(pipeline_stages, num_microbatches, **kwargs)
    else:
        (only,) = pipeline_stages
        runner = schedule_cls(only, num_microbatches, **kwargs)
    step = runner.step if backward else runner.eval
    indices = torch.arange(num_microbatches)
    holds_last = plan.num_stages - 1 in stages
    step(target=indices if holds_last else None, return_outputs=False, **{MICROBATCH_KWARG: indices})


def _forward_in_order(
    plan: PipelinePlan,
    stages: dict[int, nn.Module],
    pp_mesh: DeviceMesh,
    num_microbatches: int,
    activation: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """Forward only: each micro-batch through the stages in order, activations sent point to
    point to the rank of the next stage (no overlap between micro-batches)."""
    group = pp_mesh.get_group()
    owner = {
        stage: rank
        for rank in range(pp_mesh.size())
        for stage in stage_ids(plan.schedule, rank, pp_mesh.size(), plan.num_stages)
    }
    me = pp_mesh.get_local_rank()
    last = plan.num_stages - 1
    for i in range(num_microbatches):
        index = torch.tensor([i])
        hidden = None
        for stage in range(plan.num_stages):
            if stage not in stages:
                continue
            if stage > 0 and owner[stage - 1] != me:
                hidden = torch.empty(activation.shape, dtype=activation.dtype, device=pp_mesh.device_type)
                dist.recv(hidden, group=group, group_src=owner[stage - 1])
            hidden = stages[stage](*(() if stage == 0 else (hidden,)), **{MICROBATCH_KWARG: index})
            if stage == last:
                loss_fn(hidden, index)
            elif owner[stage + 1] != me:
                dist.send(hidden.contiguous(), group=group, group_dst=owner[stage + 1])


def full_parameters(
    model: nn.Module, names: list[str], pp_mesh: DeviceMesh | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, the whole parameter)`` for each of ``names``, in order: gathered when sharded
    (a collective of the ranks sharing it); under pipeline parallel (``pp_mesh``) gathered in
    the stage that holds it and broadcast from there over the pipeline. Every rank of the model's
    meshes asks for the same names."""
    params = dict(model.named_parameters())
    if pp_mesh is None:
        for name in names:
            yield name, full_tensor(params[name])
        return
    held = {name: (p.shape, p.dtype) for name, p in params.items()}
    everyone: list = [None] * pp_mesh.size()
    dist.all_gather_object(everyone, held, group=pp_mesh.get_group())
    owners = {}
    for rank, part in enumerate(everyone):
        for name, meta in part.items():
            owners.setdefault(name, (rank, *meta))
    for name in names:
        owner, shape, dtype = owners[name]
        if name in params:
            value = full_tensor(params[name]).contiguous()
        else:
            value = torch.empty(shape, dtype=dtype, device=pp_mesh.device_type)
        dist.broadcast(value, group=pp_mesh.get_group(), group_src=owner)
        yield name, value
