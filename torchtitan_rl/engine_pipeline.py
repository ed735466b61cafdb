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

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_rl.data.cp_split import microbatch_layout
from torchtitan_rl.data.packing import MicroBatch, pad_microbatch, padding_microbatch
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.distributed.pipeline import (
    PipelinePlan,
    attach_microbatch_inputs,
    run_schedule,
    splits_backward,
    stage_ids,
)
from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.engine import Engine, ForwardResult, PreparedBatch, _loss_inputs, sequence_slots
from torchtitan_rl.losses.logprobs import token_logprobs
from torchtitan_rl.losses.loss_fns import ForwardBackwardMetrics, resolve_loss_fn
from torchtitan_rl.losses.reduction import global_counts, token_weights
from torchtitan_rl.models.attention import cp_attention_context
from torchtitan_rl.models.lora import effective_weight


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
        for module in self.stages.values():
            attach_microbatch_inputs(module, self._stage_inputs)
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
        cp_mesh = self.parallel_dims.mesh("cp")
        if cp_mesh is None:
            return (first, mb.positions, mb.seq_ids), {}
        # A CP share attends to the keys of every share of its micro-batch.
        attention = cp_attention_context(cp_mesh, self.model.args.attn_backend, mb.seq_ids, mb.positions)
        return (first, mb.positions, mb.seq_ids), {"attention": attention}

    def _agree(self, batch: PreparedBatch) -> PreparedBatch:
        """``Engine._agree``, then filler up to what the schedule needs (at least one
        micro-batch per pipeline rank, a multiple of them for the multi-stage schedules) and
        every micro-batch (every context-parallel share) padded to the step's longest.
        Attention is planned in each stage's forward (of the padded micro-batch)."""
        batch = super()._agree(batch)
        dims = self.parallel_dims
        count = max(len(batch.whole), dims.pp)
        if len(self.plan.local_stages) > 1:
            count = -(-count // dims.pp) * dims.pp
        whole = batch.whole + [padding_microbatch(1, batch.inputs) for _ in range(count - len(batch.whole))]
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
            if self.options.temperature != 1.0:
                hidden = hidden / self.options.temperature
            with self._autocast():
                microbatches[i], value, logprobs, entropy = self._microbatch_loss(
                    microbatches[i], weights[i], hidden, loss
                )
            values[i], outputs[i] = value.detach(), (logprobs, entropy)
            return value

        self._run(microbatches, last_stage_loss, backward=True)
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
        return self._from_last_stage(fb)

    @torch.no_grad()
    def forward(self, samples: list[Sample], with_entropy: bool = False) -> ForwardResult:
        """``Engine.forward`` through the pipeline (forward only)."""
        batch = self._agree(self._prepare(samples, ()))
        microbatches = [mb.to(self.device) for mb in batch.shares]
        per_token: dict[int, torch.Tensor] = {}

        def last_stage_logprobs(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            i = int(index)
            if self.options.temperature != 1.0:
                hidden = hidden / self.options.temperature
            with self._autocast():
                logprobs, entropy = token_logprobs(
                    hidden,
                    effective_weight(self.model.output),
                    microbatches[i].labels,
                    self.options.logits_chunk_size,
                    with_entropy=with_entropy,
                    **self._logprob_options(),
                )
            per_token[i] = torch.stack([v for v in (logprobs, entropy) if v is not None], 1)
            return logprobs.sum()

        self._run(microbatches, last_stage_logprobs, backward=False)
        for module in self.stages.values():
            reshard(module)
        result = None
        if self.holds_last:
            per_sample = self._per_sample(batch, [per_token[i] for i in range(len(microbatches))])
            result = ForwardResult(
                [values[:, 0] for values in per_sample],
                [values[:, -1] for values in per_sample] if with_entropy else None,
            )
        return self._from_last_stage(result)

    def _from_last_stage(self, value):
        """``value`` as the rank holding the last stage has it, on every rank of the pipeline."""
        box = [value]
        dist.broadcast_object_list(box, group=self.pp_mesh.get_group(), group_src=self._last_stage_rank)
        return box[0]

    def num_params(self) -> int:
        """The whole model's parameters: every stage's."""
        local = torch.tensor(super().num_params(), dtype=torch.int64, device=self.device)
        return int(all_reduce(local, "sum", self.pp_mesh))

    def optim_step(self) -> dict[str, torch.Tensor | float]:
        """``Engine.optim_step`` with the gradient norm over every stage's parameters."""
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.options.max_norm, self.pp_mesh)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}
