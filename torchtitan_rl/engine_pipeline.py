"""The engine under pipeline parallelism: the same prepared batches, counts, weights and losses
as ``engine.Engine``, run through this rank's pipeline stages by a schedule of
``torch.distributed.pipelining`` (docs/design.md, 'Pipeline parallel').

Every rank of a pipeline prepares the same micro-batches (the pipeline ranks are not data
parallel) and learns the same global counts, so the last stage's loss of micro-batch ``i`` is
already its weighted share of the mini-batch loss: the schedule sums the micro-batches'
gradients (``scale_grads=False``). The step's micro-batches are padded to one length (stages
exchange fixed-shape activations); the padding is a zero-weight pseudo-sequence, counted
nowhere. The last stage's results reach the other stages by one small broadcast, so every rank
returns the same metrics.
"""

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_rl.data.cp_split import microbatch_layout
from torchtitan_rl.data.packing import MicroBatch, pad_microbatch, padding_microbatch
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.distributed.pipeline import (
    PipelinePlan,
    attach_microbatch_inputs,
    num_microbatches_for,
    run_schedule,
    splits_backward,
    stage_ids,
)
from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.engine import Engine, ForwardResult, PreparedBatch, _loss_inputs, sequence_slots
from torchtitan_rl.losses.loss_fns import ForwardBackwardMetrics, resolve_loss_fn
from torchtitan_rl.losses.reduction import global_counts, token_weights
from torchtitan_rl.losses.router import RouterMetrics, partial_router_losses
from torchtitan_rl.models.attention import cp_attention_context
from torchtitan_rl.models.vlm.model import VisionInputs


class PipelineEngine(Engine):
    """``Engine`` over the pipeline stages ``model.pipeline_stages`` (``recipes.base.build_model``
    with a ``PipelinePlan``); ``model`` holds this rank's parameters under the whole model's names."""

    def __init__(self, model, *, pipeline: PipelinePlan, activation_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(model, **kwargs)
        self.plan = pipeline
        self.backward_twice = splits_backward(pipeline.schedule)
        # The dtype hidden states leave a stage in (the compute dtype).
        self.activation_dtype = activation_dtype
        self.stages = model.pipeline_stages
        self.pp_mesh = self.parallel_dims.mesh("pp")
        # The micro-batches of the schedule running now, read by the stages' forward.
        self._running: list[MicroBatch] = []
        # What the stages of a MoE model do with their router statistics in the pass running now.
        self._routing: _RouterPass | None = None
        self._stage_of = {id(module): stage for stage, module in self.stages.items()}
        moe_layers = list(model.args.moe_layers) if model.args.is_moe else []
        # Per local stage: its MoE layers' positions among the model's MoE layers.
        self._moe_slots = {
            stage: [moe_layers.index(i) for i in pipeline.layers[stage] if i in moe_layers] for stage in self.stages
        }
        self._num_moe_layers = len(moe_layers)
        last = pipeline.num_stages - 1
        self.holds_last = last in self.stages
        # The pipeline rank holding the last stage (rank 0 under a V-shaped schedule).
        self._last_stage_rank = next(
            rank
            for rank in range(self.parallel_dims.pp)
            if last in stage_ids(pipeline.schedule, rank, self.parallel_dims.pp, pipeline.num_stages)
        )

    def _stage_inputs(self, index: int, activations: tuple) -> tuple[tuple, dict[str, Any]]:
        mb = self._running[index]
        first = activations[0] if activations else mb.input_ids
        kwargs = {}
        if not activations and mb.image_patches is not None:  # the first stage encodes the images
            kwargs["vision"] = VisionInputs(mb.image_patches, mb.image_grids, mb.vision_index)
        cp_mesh = self.parallel_dims.mesh("cp")
        if cp_mesh is not None:
            # A CP share attends to the keys of every share of its micro-batch.
            kwargs["attention"] = cp_attention_context(cp_mesh, self.model.args.attn_backend, mb.seq_ids, mb.positions)
        if self.options.router is not None:
            kwargs.update(self._routing_kwargs(mb))
        return (first, mb.positions, mb.seq_ids), kwargs

    def _stage_output(self, module, index: int, output) -> torch.Tensor:
        """The hidden states a stage passes on. A MoE stage's router statistics stay with it:
        counted in a counting pass, or turned into its share of the router losses, whose
        gradient joins the hidden states' in backward (``_WithLoss``)."""
        if self.options.router is None:
            return output
        hidden, stats = output
        routing = self._routing
        if routing is None:  # a forward-only pass: nothing to count
            return hidden
        stage = self._stage_of[id(module)]
        if routing.counting:
            routing.recorded[stage, index] = stats.counts.detach()
            return hidden
        expert_counts, mb_counts = routing.counts_for(index, self._moe_slots[stage])
        aux, z = partial_router_losses(
            self.options.router,
            stats,
            self._running[index],
            routing.batch_counts,
            self.parallel_dims,
            self.device,
            expert_counts,
            mb_counts,
        )
        routing.add(self._moe_slots[stage], aux.detach(), z.detach(), stats.counts.sum(1), stats.agreement)
        router = self.options.router
        return _WithLoss.apply(hidden, router.aux_loss_coef * aux + router.z_loss_coef * z)

    def _agree(self, batch: PreparedBatch) -> PreparedBatch:
        """``Engine._agree``, then filler up to what the schedule needs
        (``num_microbatches_for``) and
        every micro-batch (every context-parallel share) padded to the step's longest.
        Attention is planned in each stage's forward (of the padded micro-batch)."""
        batch = super()._agree(batch)
        dims = self.parallel_dims
        count = num_microbatches_for(self.plan.schedule, len(batch.whole), dims.pp)
        filler = [padding_microbatch(1, batch.inputs, self.options.vision) for _ in range(count - len(batch.whole))]
        whole = batch.whole + filler
        if dims.mesh("cp") is None:
            length = max(mb.num_tokens for mb in whole)
            length = -(-length // self._pad_multiple()) * self._pad_multiple()
            whole = [pad_microbatch(mb, length) for mb in whole]
        else:
            # A share holds 1 / cp of its whole micro-batch's sequences, each padded to a
            # multiple of 2 cp tp: lengthening the padding sequence by a multiple of that
            # lengthens every share by exactly 1 / cp of it.
            share_lens = [microbatch_layout(mb, dims.cp, dims.tp).num_padded_tokens // dims.cp for mb in whole]
            longest = max(share_lens)
            whole = [pad_microbatch(mb, mb.num_tokens + (longest - n) * dims.cp) for mb, n in zip(whole, share_lens)]
        whole, shares = self._shares(whole)
        # Per-sequence losses read the real micro-batches only (``Engine._max_sequence_mean_loss``).
        num_slots, slots, mask = sequence_slots([mb for mb in shares if not mb.is_padding])
        return replace(
            batch,
            whole=whole,
            shares=shares,
            attention=[None] * len(whole),
            num_seq_slots=num_slots,
            seq_slots=slots,
            loss_token_mask=mask,
        )

    def _run(self, microbatches: list[MicroBatch], loss_fn, backward: bool) -> None:
        self._running = microbatches
        # Several engines may share the model's stages (one per reduction mode): the running one
        # feeds them.
        for module in self.stages.values():
            attach_microbatch_inputs(module, self._stage_inputs, self._stage_output)
        hidden_rows = microbatches[0].num_tokens // self.parallel_dims.tp  # sequence-parallel shard
        try:
            with self._autocast():
                run_schedule(
                    self.plan,
                    self.stages,
                    self.pp_mesh,
                    self.device,
                    num_microbatches=len(microbatches),
                    activation=torch.empty(
                        hidden_rows, self.model.args.dim, dtype=self.activation_dtype, device="meta"
                    ),
                    loss_fn=loss_fn,
                    backward=backward,
                )
        finally:
            self._running = []

    def forward_backward(
        self,
        batch: "list[Sample] | PreparedBatch",
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
        with_logprobs: bool = False,
    ) -> ForwardBackwardMetrics:
        """``Engine.forward_backward`` through the pipeline."""
        loss = resolve_loss_fn(loss_fn, loss_fn_config)
        batch = self._agree(self._prepared(batch, _loss_inputs(loss, self.options.reduction)))
        counts = global_counts(batch.local_counts, self.parallel_dims.mesh("batch"), self.device)
        microbatches = [mb.to(self.device) for mb in batch.shares]
        weights = [token_weights(mb, self.options.reduction, counts, self.options.horizon) for mb in microbatches]
        values: dict[int, torch.Tensor] = {}
        outputs: dict[int, tuple] = {}

        def last_stage_loss(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            i = int(index)
            with self._autocast():
                microbatches[i], value, logprobs, entropy = self._microbatch_loss(
                    microbatches[i], weights[i], self._tempered(hidden), loss
                )
            values[i], outputs[i] = value.detach(), (logprobs, entropy)
            return value

        if self.options.router is not None:
            self._routing = _RouterPass(batch_counts=counts, pooled=self.options.router.aux_loss_layers == "pooled")
            if self.options.router.aux_loss_coef > 0:
                self._count_routes(microbatches)
        try:
            self._run(microbatches, last_stage_loss, backward=True)
        finally:
            routing, self._routing = self._routing, None
        fb = None
        if self.holds_last:
            order = range(len(microbatches))
            fb = self._step_metrics(
                batch,
                loss,
                microbatches,
                weights,
                [values[i] for i in order],
                [outputs[i] for i in order],
                counts,
                with_logprobs,
            )
        fb = self._from_last_stage(fb)
        return fb if routing is None else replace(fb, router=self._router_metrics(routing))

    @torch.no_grad()
    def _count_routes(self, microbatches: list[MicroBatch]) -> None:
        """The counting pass: every micro-batch routed through the pipeline without autograd, so
        that each stage knows every layer's top-k counts before its first backward (the pooled
        loss reads all layers', the global scope every micro-batch's). Counts are summed over the
        ranks that share a group's tokens (every rank of the stage for the global scope, the CP
        / TP peers for a sequence or micro-batch), then exchanged over the pipeline."""
        routing = self._routing
        routing.counting = True
        self._run(microbatches, lambda hidden, index: hidden.sum(), backward=False)
        routing.counting = False
        num_layers, dims = self._num_moe_layers, self.parallel_dims
        if self.options.router.aux_loss_scope == "global":
            mine = {
                slot: all_reduce(
                    sum(counts[k].sum(0) for (s, _), counts in routing.recorded.items() if s == stage),
                    "sum",
                    dims.mesh("world"),
                )
                for stage, slots in self._moe_slots.items()
                for k, slot in enumerate(slots)
            }
            everyone = self._gather_over_pipeline(mine)
            routing.expert_counts = torch.stack([everyone[slot] for slot in range(num_layers)])
        else:
            mine = {
                (slot, index): all_reduce(counts[k], "sum", dims.mesh("cp_tp"))
                for (stage, index), counts in routing.recorded.items()
                for k, slot in enumerate(self._moe_slots[stage])
            }
            everyone = self._gather_over_pipeline(mine)
            routing.mb_counts = [
                torch.stack([everyone[slot, index] for slot in range(num_layers)]) for index in range(len(microbatches))
            ]
        routing.recorded.clear()

    def _gather_over_pipeline(self, mine: dict[Any, torch.Tensor], merge: bool = True):
        """Every pipeline rank's ``mine`` (small tensors), on every rank: merged into one dict, or
        the list of them in pipeline order."""
        # clone() waits for a functional collective's result (pickling would not).
        mine = {key: value.clone() for key, value in mine.items()}
        everyone: list = [None] * self.parallel_dims.pp
        dist.all_gather_object(everyone, mine, group=self.pp_mesh.get_group())
        everyone = [{key: value.to(self.device) for key, value in part.items()} for part in everyone]
        return {key: value for part in everyone for key, value in part.items()} if merge else everyone

    def _router_metrics(self, routing: "_RouterPass") -> RouterMetrics:
        """The step's router metrics of every stage: the partial losses summed over the stages,
        the counts of every MoE layer in order (the same on every pipeline rank)."""
        mine = {
            "aux": routing.aux,
            "z": routing.z,
            **{("counts", slot): c for slot, c in routing.counts.items()},
            **{("agreement", slot): a for slot, a in routing.agreement.items()},
        }
        everyone = self._gather_over_pipeline(mine, merge=False)
        per_layer = {key: value for part in everyone for key, value in part.items() if isinstance(key, tuple)}
        layers = range(len(self.model.args.moe_layers))
        return RouterMetrics(
            sum(part["aux"] for part in everyone),
            sum(part["z"] for part in everyone),
            torch.stack([per_layer["counts", slot] for slot in layers]),
            tuple(self.model.args.moe_layers),
            self.options.router,
            torch.stack([per_layer["agreement", slot] for slot in layers])
            if self.options.router_replay != "off"
            else None,
        )

    @torch.no_grad()
    def forward(self, samples: list[Sample], with_entropy: bool = False) -> ForwardResult:
        """``Engine.forward`` through the pipeline (forward only)."""
        batch = self._agree(self._prepare(samples, ()))
        microbatches = [mb.to(self.device) for mb in batch.shares]
        per_token: dict[int, torch.Tensor] = {}

        def last_stage_logprobs(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            i = int(index)
            with self._autocast():
                per_token[i] = self._token_values(microbatches[i], self._tempered(hidden), with_entropy)
            return per_token[i].sum()  # the schedule wants a loss; unused

        self._run(microbatches, last_stage_logprobs, backward=False)
        for module in self.stages.values():
            reshard(module)
        result = None
        if self.holds_last:
            result = self._forward_result(batch, [per_token[i] for i in range(len(microbatches))], with_entropy)
        return self._from_last_stage(result)

    def _from_last_stage(self, value):
        """``value`` as the rank holding the last stage has it, on every rank of the pipeline."""
        box = [value]
        dist.broadcast_object_list(box, group=self.pp_mesh.get_group(), group_src=self._last_stage_rank)
        return box[0]

    def _layout_kwargs(self) -> dict[str, Any]:
        # ``over``: another model is split like this engine's.
        return {"pipeline": self.plan, "activation_dtype": self.activation_dtype}


class _WithLoss(torch.autograd.Function):
    """``hidden`` unchanged, with ``loss`` joining its backward: whatever gradient reaches the
    stage's output, ``loss`` gets gradient 1 (a stage's router losses, which never reach the
    last stage's loss)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        # A copy, not a view: zero-bubble schedules detach a stage's outputs in place.
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=torch.float32, device=grad.device)


@dataclass
class _RouterPass:
    """A MoE step's router statistics across its pipeline passes."""

    batch_counts: torch.Tensor  # losses.reduction's global counts of the mini-batch
    pooled: bool  # moe.aux_loss_layers = "pooled": each layer's loss reads every layer's counts
    counting: bool = False
    recorded: dict = field(default_factory=dict)  # (stage, micro-batch) -> its local counts [L_s, S, E]
    expert_counts: torch.Tensor | None = None  # global scope: [L, E] of the mini-batch
    mb_counts: list[torch.Tensor] | None = None  # other scopes: per micro-batch [L, S, E]
    aux: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    z: torch.Tensor = field(default_factory=lambda: torch.zeros(()))
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer slot -> this rank's [E]
    agreement: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer slot -> this rank's [2]

    def counts_for(self, index: int, slots: list[int]):
        """(expert_counts, mb_counts) for ``losses.router.partial_router_losses``: every layer's (pooled) or the
        stage's layers' (summed over layers); None where the stage counts by itself."""
        expert = self.expert_counts
        mb = None if self.mb_counts is None else self.mb_counts[index]
        if not self.pooled:
            expert = None if expert is None else expert[slots]
            mb = None if mb is None else mb[slots]
        return expert, mb

    def add(
        self, slots: list[int], aux: torch.Tensor, z: torch.Tensor, counts: torch.Tensor, agreement: torch.Tensor
    ) -> None:
        self.aux = self.aux.to(aux.device) + aux
        self.z = self.z.to(z.device) + z
        for k, slot in enumerate(slots):
            self.counts[slot] = self.counts[slot] + counts[k] if slot in self.counts else counts[k]
            self.agreement[slot] = self.agreement[slot] + agreement[k] if slot in self.agreement else agreement[k]
