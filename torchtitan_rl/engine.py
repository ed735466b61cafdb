"""The training engine: micro-batching, weighted losses, gradient accumulation, optimizer.

Trainers hand it the rank's share of a mini-batch; it knows meshes, devices and
micro-batches (docs/design.md, 'Engine and recipes'). Gradients of successive ``forward_backward`` calls add up
until ``optim_step`` (Tinker semantics).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtitan_rl.data.balance import DEFAULT_COST_MODEL, CostModel, plan_microbatches, spread_microbatches
from torchtitan_rl.data.cp_split import shard_microbatch
from torchtitan_rl.data.packing import MicroBatch, VisionPacking, build_microbatches, padding_microbatch
from torchtitan_rl.data.sample import Sample, find_input_problem, find_routing_problem, find_vision_problem
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.context_parallel import gather_from_cp_ranks
from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.pipeline import full_parameters
from torchtitan_rl.distributed.utils import all_reduce, host_max
from torchtitan_rl.losses.logprobs import token_logprobs, token_loss
from torchtitan_rl.losses.loss_fns import (
    ForwardBackwardMetrics,
    LossMetrics,
    old_logprobs,
    per_token_loss,
    resolve_loss_fn,
    token_terms,
    weighted_loss,
)
from torchtitan_rl.losses.reduction import (
    GROUPED_MODES,
    global_counts,
    local_counts,
    token_weights,
)
from torchtitan_rl.losses.rollout_weights import sequence_log_ratio, weights_of
from torchtitan_rl.losses.router import RouterLossConfig, RouterMetrics, partial_router_losses
from torchtitan_rl.models.attention import AttentionContext, build_attention_context, cp_attention_context
from torchtitan_rl.models.lora import effective_weight
from torchtitan_rl.models.vlm.model import VisionInputs


@dataclass(frozen=True)
class PreparedBatch:
    """A rank's samples made ready for one ``forward_backward`` (``Engine.prepare``): host
    tensors, built without any collective. ``forward_backward`` then agrees with the other
    ranks on the number of micro-batches and appends zero-weight filler."""

    inputs: tuple[str, ...]  # the optional sample inputs packed (those of the loss it was prepared for)
    num_samples: int
    problem: str | None  # why the samples cannot be trained on (then nothing else is set)
    sample_order: list[int]  # the samples' indices in the order they were packed
    whole: list[MicroBatch]  # whole micro-batches (counts come from them)
    shares: list[MicroBatch]  # this rank's share of each (the whole ones without context parallel)
    attention: list[AttentionContext | None]  # per share, planned ahead; None: built in the forward
    num_groups: int  # prompt groups (0 unless ``inputs`` has ``group_id``)
    local_counts: torch.Tensor  # losses.reduction.local_counts of ``whole``
    # Every sequence of the real shares has a slot (their padding pseudo-sequences too): each
    # real token's slot and float32 loss mask, in order, for the step's per-sequence losses.
    num_seq_slots: int
    seq_slots: torch.Tensor
    loss_token_mask: torch.Tensor


@dataclass
class ForwardResult:
    """Per-token values of each sample's labels, in the samples' order, on the CPU like every
    per-token tensor of a ``Sample`` (so they can be attached to samples and packed)."""

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None  # when asked for


@dataclass(kw_only=True)
class EngineOptions:
    reduction: str
    horizon: int
    max_tokens_per_microbatch: int
    logits_chunk_size: int
    max_norm: float
    loss_parallel: bool = True
    # Pack each rank's samples into the fewest micro-batches of about equal cost, costliest
    # first (data.balance.plan_microbatches), instead of in order: with compute balancing the
    # data-parallel ranks then meet at every micro-batch with about the same work done.
    balance_microbatches: bool = False
    # The model's estimated compute per sample (from its widths), which that balancing evens out.
    cost_model: CostModel = DEFAULT_COST_MODEL
    # Log-probs, entropies and losses are of softmax(logits / temperature): RL trains on the
    # distribution its sampler drew from.
    temperature: float = 1.0
    # Vision-language models: how micro-batches carry images (None: a text model, whose
    # samples must have none), and the vision-patch budget of a micro-batch (0: none).
    vision: VisionPacking | None = None
    max_patches_per_microbatch: int = 0
    # MoE models: their router losses (None: a dense model).
    router: RouterLossConfig | None = None
    # MoE models: what the forwards do with the experts a sampler recorded (``Sample.routed_experts``):
    # "rollout" routes those tokens to them, "record" only compares (moe/routing_agreement), "off" ignores them.
    router_replay: str = "off"
    # Split a rank's samples into at least this many micro-batches when they have enough
    # samples (pipeline parallel: the stages work on different micro-batches at once).
    min_microbatches: int = 1


class Engine:
    # Whether a loss's backward may run twice (zero-bubble pipeline schedules, ``engine_pipeline``).
    backward_twice = False

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler,
        parallel_dims: ParallelDims,
        device: torch.device,
        options: EngineOptions,
        autocast_dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.parallel_dims = parallel_dims
        self.device = device
        self.options = options
        # Only used without FSDP on CUDA; with FSDP its mixed-precision policy casts.
        self.autocast_dtype = autocast_dtype

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def prepare(
        self, samples: list[Sample], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, Any] | None = None
    ) -> PreparedBatch:
        """This rank's samples made ready for ``forward_backward`` (or ``forward``) with this loss:
        checked, planned, packed into micro-batches, counted, and (when the model runs on the
        CPU without context parallel) their attention planned.

        Host work only, no collective and no device: a loader runs it on its prefetch thread
        while the previous step trains. A bad sample is not raised here but recorded, so that
        every rank learns of it in the step's agreement collective (see ``forward_backward``).
        """
        return self._prepare(samples, _loss_inputs(resolve_loss_fn(loss_fn, loss_fn_config), self.options.reduction))

    def _prepare(self, samples: list[Sample], inputs: tuple[str, ...]) -> PreparedBatch:
        dims, options = self.parallel_dims, self.options
        vision = options.vision
        problem, plan = find_input_problem(samples, inputs), []
        if problem is None:
            patch_dim, merge_size = (vision.patch_dim, vision.merge_size) if vision is not None else (None, 1)
            problem = find_vision_problem(samples, patch_dim, merge_size)
        if problem is None and self.options.router_replay != "off":
            args = self.model.args
            problem = find_routing_problem(
                samples, len(args.moe_layers), args.num_experts_per_tok, args.num_experts if args.is_moe else 0
            )
        if problem is None:
            try:
                plan = plan_microbatches(
                    [len(s) for s in samples],
                    options.max_tokens_per_microbatch,
                    [s.num_patches for s in samples],
                    options.max_patches_per_microbatch,
                    balanced=options.balance_microbatches,
                    cost_model=options.cost_model,
                )
            except ValueError as err:
                problem = str(err)
            plan = spread_microbatches(plan, [len(s) for s in samples], options.min_microbatches)
        if problem is not None:
            nothing = torch.zeros(0, dtype=torch.long)
            return PreparedBatch(inputs, len(samples), problem, [], [], [], [], 0, nothing, 0, nothing, nothing.float())
        num_groups = 1 + max((s.group_id for s in samples), default=-1) if "group_id" in inputs else 0
        whole, shares = self._shares(build_microbatches(samples, plan, len(plan), self._pad_multiple(), inputs, vision))
        attention = [None] * len(shares)
        if self.device.type == "cpu" and dims.mesh("cp") is None:
            # Planning attention is host work (sdpa_varlen sorts and buckets the documents);
            # built here it leaves the step. On CUDA, flex builds its block mask on the device
            # inside the forward, without a host sync.
            backend = self.model.args.attn_backend
            attention = [build_attention_context(backend, mb.seq_ids, mb.positions) for mb in shares]
        return PreparedBatch(
            inputs,
            len(samples),
            None,
            [i for group in plan for i in group],
            whole,
            shares,
            attention,
            num_groups,
            local_counts(whole, num_groups),
            *sequence_slots(shares),
        )

    def _pad_multiple(self) -> int:
        # Sequence parallel shards every micro-batch's tokens evenly over the TP ranks; under CP
        # the split pads every sequence so that each rank's share divides by tp instead.
        return self.parallel_dims.tp if self.parallel_dims.mesh("cp") is None else 1

    def _shares(self, whole: list[MicroBatch]) -> tuple[list[MicroBatch], list[MicroBatch]]:
        """Whole micro-batches and this rank's shares of them (the same ones without CP)."""
        cp_mesh = self.parallel_dims.mesh("cp")
        if cp_mesh is None:
            return whole, whole
        rank = cp_mesh.get_local_rank()
        return whole, [
            shard_microbatch(mb, self.parallel_dims.cp, rank, multiple=self.parallel_dims.tp) for mb in whole
        ]

    def _agree(self, batch: PreparedBatch) -> PreparedBatch:
        """The step's one blocking collective: every rank of the batch mesh learns whether any
        rank has a bad sample, how many micro-batches the busiest rank has (the others run
        zero-weight filler so that FSDP's collectives match) and how many prompt groups there
        are. A bad sample on one rank stops all of them with a ValueError instead of leaving
        the others waiting in a collective. A small gloo all-reduce of host integers: no device
        sync."""
        dims = self.parallel_dims
        num_microbatches, num_groups, failed, max_samples = host_max(
            [len(batch.whole), batch.num_groups, int(batch.problem is not None), batch.num_samples], dims.mesh("batch")
        )
        if failed:
            raise ValueError(
                batch.problem or "another data-parallel rank refused its samples; its error names the cause"
            )
        if num_groups > max_samples * dims.batch_degree:
            raise ValueError(
                f"group_id {num_groups - 1} is out of range: group ids number the prompt groups of the "
                f"mini-batch from 0, and it has at most {max_samples * dims.batch_degree} samples"
            )
        num_filler = max(1, num_microbatches) - len(batch.whole)
        filler_whole, filler_shares = self._shares(
            [padding_microbatch(self._pad_multiple(), batch.inputs, self.options.vision) for _ in range(num_filler)]
        )
        # Every rank's count vector has a slot for every prompt group of the mini-batch.
        counts = torch.cat((batch.local_counts, batch.local_counts.new_zeros(num_groups - batch.num_groups)))
        return replace(
            batch,
            whole=batch.whole + filler_whole,
            shares=batch.shares + filler_shares,
            attention=batch.attention + [None] * num_filler,
            num_groups=num_groups,
            local_counts=counts,
        )

    def _forward(self, mb: MicroBatch, attention: AttentionContext | None = None):
        """The model's final hidden states of a device-resident micro-batch, and a MoE model's
        router statistics (None for a dense model). ``attention``: the micro-batch's context
        planned in ``prepare``; None builds it in the model's forward."""
        kwargs = {} if attention is None else {"attention": attention}
        if mb.image_patches is not None:
            kwargs["vision"] = VisionInputs(mb.image_patches, mb.image_grids, mb.vision_index)
        cp_mesh = self.parallel_dims.mesh("cp")
        if cp_mesh is not None:
            # A CP share attends to the keys of every share of its micro-batch.
            kwargs["attention"] = cp_attention_context(cp_mesh, self.model.args.attn_backend, mb.seq_ids, mb.positions)
        if self.options.router is None:
            return self.model(mb.input_ids, mb.positions, mb.seq_ids, **kwargs), None
        return self.model(mb.input_ids, mb.positions, mb.seq_ids, **self._routing_kwargs(mb), **kwargs)

    def _routing_kwargs(self, mb: MicroBatch) -> dict[str, Any]:
        """A MoE model's per-micro-batch routing inputs: which tokens its statistics count (padding
        never: how much of it there is depends on the layout) and, with routing replay, the
        experts the sampler recorded."""
        kwargs = {"router_mask": mb.real_token_mask(), "num_seqs": mb.num_seqs}
        if self.options.router_replay != "off" and mb.routed_experts is not None:
            kwargs.update(routed_experts=mb.routed_experts, replay_routing=self.options.router_replay == "rollout")
        return kwargs

    def _hidden(self, mb: MicroBatch, attention: AttentionContext | None) -> tuple[torch.Tensor, object]:
        """The final hidden states of a device-resident micro-batch, divided by the sampling
        temperature, and the router statistics of a MoE model (else None)."""
        hidden, router_stats = self._forward(mb, attention)
        return self._tempered(hidden), router_stats

    def _tempered(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states divided by the sampling temperature: (h / T) W = (h W) / T, on a
        [T, dim] tensor instead of [T, vocab] logits."""
        return hidden if self.options.temperature == 1.0 else hidden / self.options.temperature

    def _token_values(self, mb: MicroBatch, hidden: torch.Tensor, with_entropy: bool) -> torch.Tensor:
        """``[T, 1]`` log-probs of the labels of a device-resident micro-batch from its (tempered)
        hidden states, ``[T, 2]`` with the entropies; no gradient."""
        logprobs, entropy = token_logprobs(
            hidden,
            effective_weight(self.model.output),
            mb.labels,
            self.options.logits_chunk_size,
            with_entropy=with_entropy,
            **self._logprob_options(),
        )
        return torch.stack([v for v in (logprobs, entropy) if v is not None], 1)

    def _forward_result(self, batch: PreparedBatch, per_token: list[torch.Tensor], with_entropy: bool) -> ForwardResult:
        """``forward``'s result from the shares' ``_token_values``."""
        per_sample = self._per_sample(batch, per_token)
        return ForwardResult(
            [values[:, 0] for values in per_sample], [values[:, -1] for values in per_sample] if with_entropy else None
        )

    def _logprob_options(self) -> dict[str, Any]:
        return {"tp_mesh": self.parallel_dims.mesh("tp"), "loss_parallel": self.options.loss_parallel}

    def forward_backward(
        self,
        batch: "list[Sample] | PreparedBatch",
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None,
        with_logprobs: bool = False,
    ) -> ForwardBackwardMetrics:
        """Accumulate the gradient of ``Σ_t w_t ℓ_t`` over this rank's samples.

        ``batch`` is the samples, or what ``prepare`` made of them for the same loss (a loader
        prepares on its prefetch thread). ``loss_fn`` names an entry of
        ``losses.loss_fns.LOSS_FNS``; ``loss_fn_config`` sets its options (clip bounds,
        ``kl_coef``, ``entropy_coef``, ...). The samples must carry the inputs the loss reads
        (advantages, sampler / reference log-probs, and a ``group_id`` under ``prompt_mean``).
        ``with_logprobs``: also return each sample's per-token log-probs under the weights before
        this update (the pass's own, detached; ``ForwardBackwardMetrics.logprobs``).
        """
        loss = resolve_loss_fn(loss_fn, loss_fn_config)
        batch = self._agree(self._prepared(batch, _loss_inputs(loss, self.options.reduction)))
        microbatches = batch.shares
        # Counts come from whole sequences: a CP share would miscount n_i and B.
        counts = global_counts(batch.local_counts, self.parallel_dims.mesh("batch"), self.device)
        router = self.options.router
        # The global load-balancing loss needs the counts of every micro-batch before the first
        # backward; with one micro-batch per rank its own forward provides them.
        needs_counting_pass = router is not None and router.needs_global_counts and len(microbatches) > 1
        expert_counts = self._expert_counts(batch) if needs_counting_pass else None
        router_metrics = None
        # The small per-token work (weights before, metrics after) runs for all micro-batches
        # at once: on a CPU the first small op after a large one pays for cold caches, so
        # interleaving it with the passes would cost that once per micro-batch.
        microbatches = [mb.to(self.device) for mb in microbatches]
        weights = [token_weights(mb, self.options.reduction, counts, self.options.horizon) for mb in microbatches]
        values, outputs = [], []
        for i, (mb, mb_weights, attention) in enumerate(zip(microbatches, weights, batch.attention)):
            if isinstance(self.model, FSDPModule):
                # Accumulate unsharded gradients locally; reduce-scatter their sum once.
                self.model.set_requires_gradient_sync(i == len(microbatches) - 1)
            with self._autocast():
                hidden, router_stats = self._hidden(mb, attention)
                microbatches[i], value, logprobs, entropy = self._microbatch_loss(mb, mb_weights, hidden, loss)
            objective = value
            if router_stats is not None:
                aux, z = partial_router_losses(
                    router, router_stats, mb, counts, self.parallel_dims, self.device, expert_counts
                )
                router_metrics = self._add_router_metrics(router_metrics, router_stats, aux, z)
                # Logged apart (moe/*): their partials are spread over TP ranks too, unlike the token loss's.
                objective = value + router.aux_loss_coef * aux + router.z_loss_coef * z
            objective.backward()
            values.append(value.detach())
            outputs.append((logprobs, entropy))
            del objective, value, hidden, router_stats
        fb = self._step_metrics(batch, loss, microbatches, weights, values, outputs, counts, with_logprobs)
        return replace(fb, router=router_metrics)

    def _microbatch_loss(self, mb: MicroBatch, weights: torch.Tensor, hidden: torch.Tensor, loss):
        """``(mb with its sequence inputs, Σ_t w_t ℓ_t, log-probs, entropies)`` of one device-resident
        micro-batch from its final hidden states: the loss and its gradient with respect to the
        hidden states and output weight, chunk by chunk; backward through the model starts from there."""
        mb = self._sequence_inputs(mb, hidden, loss)

        def loss_of_chunk(start, end, logprobs, entropy):
            chunk = mb.map_tokens(lambda t: t[start:end])
            return weighted_loss(loss, token_terms(loss, logprobs, entropy, chunk), weights[start:end])

        value, logprobs, entropy = token_loss(
            hidden,
            effective_weight(self.model.output),
            mb.labels,
            self.options.logits_chunk_size,
            loss_of_chunk,
            with_entropy=loss.needs_entropy,
            entropy_grad=loss.options["entropy_coef"] != 0,
            backward_twice=self.backward_twice,
            **self._logprob_options(),
        )
        return mb, value, logprobs, entropy

    def _step_metrics(self, batch, loss, microbatches, weights, values, outputs, counts, with_logprobs) -> dict:
        """``ForwardBackwardMetrics`` (without router metrics) from the micro-batches' losses and
        per-token outputs."""
        metrics, token_losses = LossMetrics(), []
        for mb, mb_weights, (logprobs, entropy) in zip(microbatches, weights, outputs):
            terms = token_terms(loss, logprobs, entropy, mb)  # detached: for metrics
            metrics.add(terms, mb_weights)
            if not mb.is_padding:
                token_losses.append(per_token_loss(loss, terms))
        return ForwardBackwardMetrics(
            loss=torch.stack(values).sum(),
            max_seq_loss=self._max_sequence_mean_loss(batch, token_losses),
            counts=counts,
            terms=metrics,
            logprobs=[values[:, 0] for values in self._per_sample(batch, [lp[:, None] for lp, _ in outputs])]
            if with_logprobs
            else None,
        )

    @torch.no_grad()
    def _sequence_inputs(self, mb: MicroBatch, hidden: torch.Tensor, loss) -> MicroBatch:
        """``mb`` with what its loss needs of whole sequences before any token's loss: GSPO's
        ``seq_log_ratio`` (each token's ``mean(logp_θ − logp_old)`` over its sequence's loss
        tokens, or its ``ratio_mask``'s; 0 for a sequence without any) and a per-sequence
        rollout correction's weights (from ``Σ_t log ρ_t`` over the sequence's loss tokens,
        ``ρ_t`` = current / sampler).

        Their log-probs come from a gradient-free pass of the output head over ``hidden`` (no
        model forward). A sequence is never split over micro-batches, but its tokens may be
        spread over the logits chunks of this pass and over the CP ranks: its sums are taken
        over every token of this share, then summed over ``cp``, so every token of a sequence
        sees the same values on every rank and for any layout.
        """
        options, mask = loss.options, mb.loss_mask
        correction = options["rollout_correction"]
        seq_weights = correction is not None and correction.per_sequence
        updates = {}
        if loss.needs_sequence_log_ratio and options["current_proximal"]:
            # The ratio's old policy is the current one: every sequence's log-ratio is exactly 0.
            updates["seq_log_ratio"] = torch.zeros(mask.shape, device=self.device)
        gspo = loss.needs_sequence_log_ratio and "seq_log_ratio" not in updates
        if not (gspo or seq_weights):
            return replace(mb, **updates)
        logprobs, _ = token_logprobs(
            hidden,
            effective_weight(self.model.output),
            mb.labels,
            self.options.logits_chunk_size,
            **self._logprob_options(),
        )
        logprobs = logprobs.float()
        old = old_logprobs(mb, options, logprobs)
        # (tokens, values) of each per-sequence mean; GSPO's over its ratio mask when it has one.
        ratio_tokens = mb.ratio_mask != 0 if options["ratio_mask"] else mask
        rows = ([(ratio_tokens, logprobs - old)] if gspo else []) + (
            [(mask, old - mb.sampler_logprobs)] if seq_weights else []
        )
        per_token = torch.stack(
            [torch.where(tokens, row, 0.0) for tokens, row in rows] + [tokens.float() for tokens, _ in rows]
        )
        per_seq = torch.zeros(len(per_token), mb.num_seqs, device=self.device)
        # Bitwise repeatable on CUDA only under debug.deterministic (index_add_ uses atomics there).
        per_seq.index_add_(1, mb.seq_ids, per_token)
        per_seq = all_reduce(per_seq, "sum", self.parallel_dims.mesh("cp"))
        sums, counts = per_seq[: len(rows)], per_seq[len(rows) :]
        if gspo:
            updates["seq_log_ratio"] = (sums[0] / counts[0].clamp(min=1))[mb.seq_ids]
        if seq_weights:
            updates["rollout_weights"] = weights_of(
                correction, sequence_log_ratio(correction, sums[-1], counts[-1])[mb.seq_ids], mask
            )
        return replace(mb, **updates)

    def _prepared(self, batch: "list[Sample] | PreparedBatch", inputs: tuple[str, ...]) -> PreparedBatch:
        if not isinstance(batch, PreparedBatch):
            return self._prepare(batch, inputs)
        if batch.inputs != inputs:
            raise ValueError(
                f"the batch was prepared for a loss reading {batch.inputs or 'no inputs'}, but this one reads "
                f"{inputs or 'none'}: prepare it with the same loss_fn and reduction"
            )
        return batch

    def _max_sequence_mean_loss(self, batch: PreparedBatch, token_losses: list[torch.Tensor]) -> torch.Tensor:
        """Largest mean loss over the loss tokens of one sequence, among this rank's sequences
        with loss tokens (-inf if none has any; RL losses can be negative), from the per-token
        losses of the batch's real micro-batches.

        One pass for the whole step: every sequence of the step has its own slot
        (``PreparedBatch.seq_slots``). Under context parallel each rank holds part of every
        sequence: the per-sequence sums and counts are summed over ``cp`` before dividing.
        """
        if not token_losses:
            return torch.full((), -torch.inf, device=self.device)
        # Asynchronous like the micro-batches' copies (``MicroBatch.to``): the step never waits for the device.
        slots = batch.seq_slots.to(self.device, non_blocking=True)
        mask = batch.loss_token_mask.to(self.device, non_blocking=True)
        per_seq = torch.zeros(2, batch.num_seq_slots, device=self.device)
        per_seq.index_add_(1, slots, torch.stack((torch.cat(token_losses) * mask, mask)))
        per_seq_sum, per_seq_count = all_reduce(per_seq, "sum", self.parallel_dims.mesh("cp"))
        means = per_seq_sum / per_seq_count.clamp(min=1)
        return torch.where(per_seq_count > 0, means, -torch.inf).max()

    @torch.no_grad()
    def _expert_counts(self, batch: PreparedBatch) -> torch.Tensor:
        """Top-k counts ``[L, E]`` of every real token of the mini-batch (every rank), from a
        counting pass through the model body (no LM head, no autograd)."""
        total = None
        for mb, attention in zip(batch.shares, batch.attention):
            with self._autocast():
                _, stats = self._forward(mb.to(self.device), attention)
            counts = stats.counts.sum(1)
            total = counts if total is None else total + counts
        return all_reduce(total, "sum", self.parallel_dims.mesh("world"))

    def _add_router_metrics(
        self, metrics: RouterMetrics | None, stats, aux: torch.Tensor, z: torch.Tensor
    ) -> RouterMetrics:
        counts = stats.counts.sum(1)
        if metrics is None:
            return RouterMetrics(
                aux.detach(),
                z.detach(),
                counts,
                tuple(self.model.args.moe_layers),
                self.options.router,
                stats.agreement if self.options.router_replay != "off" else None,
            )
        metrics.aux_loss = metrics.aux_loss + aux.detach()
        metrics.z_loss = metrics.z_loss + z.detach()
        metrics.counts = metrics.counts + counts
        if metrics.agreement is not None:
            metrics.agreement = metrics.agreement + stats.agreement
        return metrics

    @torch.no_grad()
    def forward(self, samples: list[Sample], with_entropy: bool = False) -> ForwardResult:
        """Per-token log-probabilities of each sample's labels (and entropies), in the samples' order."""
        batch = self._agree(self._prepare(samples, ()))
        per_token = []
        for mb, attention in zip(batch.shares, batch.attention):
            mb = mb.to(self.device)
            with self._autocast():
                hidden, _ = self._hidden(mb, attention)
                per_token.append(self._token_values(mb, hidden, with_entropy))
        # The root (and, under the "default" and "never" policies, blocks) keep their parameters
        # gathered after forward for the backward that usually follows; with no backward,
        # release every group so that an optimizer step cannot leave a stale gathered copy
        # behind (and ``parameters()`` yields the sharded ones again).
        reshard(self.model)
        return self._forward_result(batch, per_token, with_entropy)

    def _per_sample(self, batch: PreparedBatch, per_token: list[torch.Tensor]):
        """Each sample's rows of the per-token values ``[tokens of a share, k]`` of ``batch``'s
        shares, in the samples' order, on the CPU; gathered over ``cp``. Reads only the host
        shares' layout, so no micro-batch's device copy outlives its own pass."""
        cp_mesh = self.parallel_dims.mesh("cp")
        packed: list[torch.Tensor] = []  # per sample in packing order
        for mb, values in zip(batch.shares, per_token, strict=True):
            if mb.is_padding:
                continue
            if cp_mesh is not None:
                # Per-token scalars only (never logits).
                values = gather_from_cp_ranks(values, mb.cp_layout, cp_mesh)
            packed.extend(values[: sum(mb.seq_lens)].cpu().split(mb.seq_lens))
        return [packed[k] for k in sorted(range(len(packed)), key=batch.sample_order.__getitem__)]

    def full_parameters(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, the whole parameter)`` for each of ``names``, in order
        (``distributed.pipeline.full_parameters``: collective)."""
        return full_parameters(self.model, names, self.parallel_dims.mesh("pp"))

    def over(
        self, model: nn.Module, *, optimizer=None, lr_scheduler=None, options: EngineOptions | None = None
    ) -> "Engine":
        """An engine like this one (meshes, device, and unless given options) over ``model``, a
        model of the same architecture and layout (this one's for other options or another
        optimizer), with ``optimizer`` and ``lr_scheduler`` (None: forward passes only)."""
        return type(self)(
            model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            parallel_dims=self.parallel_dims,
            device=self.device,
            options=options or self.options,
            autocast_dtype=self.autocast_dtype,
            **self._layout_kwargs(),
        )

    def _layout_kwargs(self) -> dict[str, Any]:
        """What a subclass's constructor takes besides the engine's (``over`` passes it on)."""
        return {}

    def num_params(self) -> int:
        """The whole model's parameters (global sizes: a shard counts its whole parameter's;
        pipeline stages count each other's)."""
        local = sum(p.numel() for p in self.model.parameters())
        pp_mesh = self.parallel_dims.mesh("pp")
        if pp_mesh is None:
            return local
        return int(all_reduce(torch.tensor(local, dtype=torch.int64, device=self.device), "sum", pp_mesh))

    def optim_step(self) -> dict[str, torch.Tensor | float]:
        # Under pipeline parallel each stage holds its own parameters: the norm spans ``pp``.
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.options.max_norm, self.parallel_dims.mesh("pp"))
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}


def sequence_slots(shares: list[MicroBatch]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``PreparedBatch``'s ``num_seq_slots``, ``seq_slots`` and ``loss_token_mask`` of ``shares``."""
    offsets = [0]
    for mb in shares:
        offsets.append(offsets[-1] + mb.num_seqs)
    slots = torch.cat([torch.zeros(0, dtype=torch.long), *(mb.seq_ids + o for mb, o in zip(shares, offsets))])
    return offsets[-1], slots, torch.cat([torch.zeros(0), *(mb.loss_mask.float() for mb in shares)])


def _loss_inputs(loss, reduction: str) -> tuple[str, ...]:
    """The optional sample inputs (``data.packing.OPTIONAL_INPUTS``) a loss under a reduction mode reads."""
    return loss.inputs + (("group_id",) if reduction in GROUPED_MODES else ())
