"""The training engine: micro-batching, weighted losses, gradient accumulation, optimizer.

Trainers hand it the rank's share of a mini-batch; it knows meshes, devices and
micro-batches (docs/design.md, 'Engine and recipes'). Gradients of successive ``forward_backward`` calls add up
until ``optim_step`` (Tinker semantics).
"""

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtitan_rl.data.cp_split import shard_microbatch
from torchtitan_rl.data.packing import MicroBatch, VisionPacking, build_microbatches, plan_microbatches
from torchtitan_rl.data.sample import Sample, find_input_problem, find_vision_problem
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.context_parallel import gather_from_cp_ranks
from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.utils import all_reduce, host_max
from torchtitan_rl.losses.logprobs import token_logprobs, token_loss
from torchtitan_rl.losses.loss_fns import LossMetrics, per_token_loss, resolve_loss_fn, token_terms, weighted_loss
from torchtitan_rl.losses.reduction import (
    GROUPED_MODES,
    NUM_MICROBATCHES,
    NUM_SEQS,
    NUM_TOKENS,
    global_counts,
    token_weights,
)
from torchtitan_rl.losses.router import RouterLossConfig, balance_loss, z_loss
from torchtitan_rl.models.attention import cp_attention_context
from torchtitan_rl.models.vlm.model import VisionInputs


@dataclass
class RouterMetrics:
    """A MoE model's router statistics of one ``forward_backward`` on this rank: partial
    losses (unweighted; their sum over every rank is the mini-batch's loss) and the top-k
    counts of this rank's tokens per MoE layer and expert (summed over every rank at log time)."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    counts: torch.Tensor  # [L, E]
    layer_ids: tuple[int, ...]  # the model's MoE layers, in order
    config: RouterLossConfig


@dataclass
class ForwardBackwardMetrics:
    """Device-resident results of one ``forward_backward``; reduced only when logged."""

    loss: torch.Tensor  # this rank's Σ w·ℓ (sum over the `loss` mesh = mini-batch loss)
    max_seq_loss: torch.Tensor  # largest per-sequence mean loss among this rank's sequences (-inf: none)
    counts: torch.Tensor  # global counts, see losses.reduction
    terms: LossMetrics  # the loss's terms and statistics (rl/* tags)
    router: RouterMetrics | None = None  # MoE models only


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
    # Log-probs, entropies and losses are of softmax(logits / temperature): RL trains on the
    # distribution its sampler drew from.
    temperature: float = 1.0
    # Vision-language models: how micro-batches carry images (None: a text model, whose
    # samples must have none), and the vision-patch budget of a micro-batch (0: none).
    vision: VisionPacking | None = None
    max_patches_per_microbatch: int = 0
    # MoE models: their router losses (None: a dense model).
    router: RouterLossConfig | None = None


class Engine:
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

    def _microbatches(
        self, samples: list[Sample], inputs: tuple[str, ...] = ()
    ) -> tuple[list[MicroBatch], list[MicroBatch], int]:
        """The rank's plan as whole micro-batches (for counts) and as this rank's shares, and
        the number of prompt groups (0 unless ``inputs`` has ``group_id``).

        Every rank runs the same number of passes. Without context parallel the shares are
        the whole micro-batches; with it, each CP rank keeps its zigzag share of every one.
        Samples are checked here, and the verdict agreed on by every rank in the same small
        collective as the plan: a bad sample on one rank stops all of them with a ValueError
        instead of leaving the others waiting in a collective.
        """
        dims, options = self.parallel_dims, self.options
        vision = options.vision
        problem, plan = find_input_problem(samples, inputs), []
        if problem is None:
            patch_dim, merge_size = (vision.patch_dim, vision.merge_size) if vision is not None else (None, 1)
            problem = find_vision_problem(samples, patch_dim, merge_size)
        if problem is None:
            try:
                plan = plan_microbatches(
                    [len(s) for s in samples],
                    options.max_tokens_per_microbatch,
                    [s.num_patches for s in samples],
                    options.max_patches_per_microbatch,
                )
            except ValueError as err:
                problem = str(err)
        num_groups = (
            1 + max((s.group_id for s in samples), default=-1) if "group_id" in inputs and problem is None else 0
        )
        num_microbatches, num_groups, failed, max_samples = host_max(
            [len(plan), num_groups, int(problem is not None), len(samples)], dims.mesh("batch")
        )
        if failed:
            raise ValueError(problem or "another data-parallel rank refused its samples; its error names the cause")
        if num_groups > max_samples * dims.batch_degree:
            raise ValueError(
                f"group_id {num_groups - 1} is out of range: group ids number the prompt groups of the "
                f"mini-batch from 0, and it has at most {max_samples * dims.batch_degree} samples"
            )
        num_microbatches = max(1, num_microbatches)
        cp_mesh = dims.mesh("cp")
        if cp_mesh is None:
            # Sequence parallel shards every micro-batch's tokens evenly over the TP ranks.
            whole = build_microbatches(samples, plan, num_microbatches, dims.tp, inputs, vision)
            return whole, whole, num_groups
        # The CP split pads every sequence so that each rank's share divides by tp.
        whole = build_microbatches(samples, plan, num_microbatches, 1, inputs, vision)
        rank = cp_mesh.get_local_rank()
        return whole, [shard_microbatch(mb, dims.cp, rank, multiple=dims.tp) for mb in whole], num_groups

    def _forward(self, mb: MicroBatch):
        """The model's final hidden states of a device-resident micro-batch, and a MoE model's
        router statistics (None for a dense model)."""
        kwargs = {}
        if mb.image_patches is not None:
            kwargs["vision"] = VisionInputs(mb.image_patches, mb.image_grids, mb.vision_index)
        cp_mesh = self.parallel_dims.mesh("cp")
        if cp_mesh is not None:
            # A CP share attends to the keys of every share of its micro-batch.
            kwargs["attention"] = cp_attention_context(cp_mesh, self.model.args.attn_backend, mb.seq_ids, mb.positions)
        if self.options.router is None:
            return self.model(mb.input_ids, mb.positions, mb.seq_ids, **kwargs), None
        # Padding never enters router statistics: how much of it there is depends on the layout.
        return self.model(
            mb.input_ids, mb.positions, mb.seq_ids, router_mask=mb.real_token_mask(), num_seqs=mb.num_seqs, **kwargs
        )

    def _hidden(self, mb: MicroBatch) -> tuple[torch.Tensor, object]:
        """The final hidden states of a device-resident micro-batch, divided by the sampling
        temperature, and the router statistics of a MoE model (else None)."""
        hidden, router_stats = self._forward(mb)
        if self.options.temperature != 1.0:
            # (h / T) W = (h W) / T, on a [T, dim] tensor instead of [T, vocab] logits.
            hidden = hidden / self.options.temperature
        return hidden, router_stats

    def _logprob_options(self) -> dict[str, Any]:
        return {"tp_mesh": self.parallel_dims.mesh("tp"), "loss_parallel": self.options.loss_parallel}

    def forward_backward(
        self, samples: list[Sample], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, Any] | None = None
    ) -> ForwardBackwardMetrics:
        """Accumulate the gradient of ``Σ_t w_t ℓ_t`` over this rank's ``samples``.

        ``loss_fn`` names an entry of ``losses.loss_fns.LOSS_FNS``; ``loss_fn_config`` sets
        its options (clip bounds, ``kl_coef``, ``entropy_coef``, ...). The samples must carry
        the inputs the loss reads (advantages, sampler / reference log-probs, and a
        ``group_id`` under ``prompt_mean``).
        """
        loss = resolve_loss_fn(loss_fn, loss_fn_config)
        inputs = loss.inputs + (("group_id",) if self.options.reduction in GROUPED_MODES else ())
        whole, microbatches, num_groups = self._microbatches(samples, inputs)
        # Counts come from whole sequences: a CP share would miscount n_i and B.
        counts = global_counts(whole, self.parallel_dims.mesh("batch"), self.device, num_groups)
        cp_mesh = self.parallel_dims.mesh("cp")
        loss_total = torch.zeros((), device=self.device)
        max_seq_loss = torch.full((), -torch.inf, device=self.device)
        metrics = LossMetrics()
        router = self.options.router
        # The global load-balancing loss needs the counts of every micro-batch before the first
        # backward; with one micro-batch per rank its own forward provides them.
        needs_counting_pass = router is not None and router.needs_global_counts and len(microbatches) > 1
        expert_counts = self._expert_counts(microbatches) if needs_counting_pass else None
        router_metrics = None
        for i, mb in enumerate(microbatches):
            mb = mb.to(self.device)
            if isinstance(self.model, FSDPModule):
                # Accumulate unsharded gradients locally; reduce-scatter their sum once.
                self.model.set_requires_gradient_sync(i == len(microbatches) - 1)
            weights = token_weights(mb, self.options.reduction, counts, self.options.horizon)

            def loss_of_chunk(start, end, logprobs, entropy, mb=mb, weights=weights):
                chunk = mb.map_tokens(lambda t: t[start:end])
                return weighted_loss(loss, token_terms(loss, logprobs, entropy, chunk), weights[start:end])

            with self._autocast():
                hidden, router_stats = self._hidden(mb)
                # The loss and its gradient with respect to the hidden states and output weight,
                # chunk by chunk; backward through the model starts from there.
                value, logprobs, entropy = token_loss(
                    hidden,
                    self.model.output.weight,
                    mb.labels,
                    self.options.logits_chunk_size,
                    loss_of_chunk,
                    with_entropy=loss.needs_entropy,
                    entropy_grad=loss.options["entropy_coef"] != 0,
                    **self._logprob_options(),
                )
            terms = token_terms(loss, logprobs, entropy, mb)  # detached: for metrics
            objective = value
            if router_stats is not None:
                aux, z = self._router_losses(router_stats, mb, counts, expert_counts)
                router_metrics = self._add_router_metrics(router_metrics, router_stats, aux, z)
                # Logged apart (moe/*): their partials are spread over TP ranks too, unlike the token loss's.
                objective = value + router.aux_loss_coef * aux + router.z_loss_coef * z
            objective.backward()
            loss_total += value.detach()
            metrics.add(terms, weights)
            token_losses = per_token_loss(loss, terms).detach()
            max_seq_loss = torch.maximum(max_seq_loss, _max_sequence_mean_loss(mb, token_losses, cp_mesh))
        return ForwardBackwardMetrics(
            loss=loss_total, max_seq_loss=max_seq_loss, counts=counts, terms=metrics, router=router_metrics
        )

    @torch.no_grad()
    def _expert_counts(self, microbatches: list[MicroBatch]) -> torch.Tensor:
        """Top-k counts ``[L, E]`` of every real token of the mini-batch (every rank), from a
        counting pass through the model body (no LM head, no autograd)."""
        total = None
        for mb in microbatches:
            with self._autocast():
                _, stats = self._forward(mb.to(self.device))
            counts = stats.counts.sum(1)
            total = counts if total is None else total + counts
        return all_reduce(total, "sum", self.parallel_dims.mesh("world"))

    def _router_losses(self, stats, mb: MicroBatch, counts: torch.Tensor, expert_counts: torch.Tensor | None):
        """This rank's partial load-balancing and z losses of one micro-batch (losses.router):
        each group's counts complete (all-reduced, no gradient), the probability sums its own."""
        config = self.options.router
        num_tokens = counts[NUM_TOKENS].float()
        aux = torch.zeros((), device=self.device)
        if config.aux_loss_coef > 0:
            one = torch.ones(1, device=self.device)
            if config.aux_loss_scope == "global":
                if expert_counts is None:
                    expert_counts = all_reduce(stats.counts.sum(1), "sum", self.parallel_dims.mesh("world"))
                aux = balance_loss(
                    expert_counts[None], stats.prob_sums.sum(1)[None], num_tokens[None], one, config.aux_loss_layers
                )
            elif config.aux_loss_scope == "sequence":
                # A sequence's tokens are spread over its CP / TP peers only.
                seq_counts = all_reduce(stats.counts, "sum", self.parallel_dims.mesh("cp_tp")).transpose(0, 1)
                seq_tokens = torch.zeros(mb.num_seqs, device=self.device)
                seq_tokens[: len(mb.seq_lens)] = torch.tensor(mb.seq_lens, dtype=torch.float32)
                weights = torch.ones(mb.num_seqs, device=self.device) / counts[NUM_SEQS].clamp(min=1)
                aux = balance_loss(
                    seq_counts, stats.prob_sums.transpose(0, 1), seq_tokens, weights, config.aux_loss_layers
                )
            else:
                mb_counts = all_reduce(stats.counts.sum(1), "sum", self.parallel_dims.mesh("cp_tp"))
                mb_tokens = torch.tensor([float(sum(mb.seq_lens))], device=self.device)
                aux = balance_loss(
                    mb_counts[None],
                    stats.prob_sums.sum(1)[None],
                    mb_tokens,
                    one / counts[NUM_MICROBATCHES].clamp(min=1),
                    config.aux_loss_layers,
                )
        z = z_loss(stats.z_sums, num_tokens) if config.z_loss_coef > 0 else torch.zeros((), device=self.device)
        return aux, z

    def _add_router_metrics(
        self, metrics: "RouterMetrics | None", stats, aux: torch.Tensor, z: torch.Tensor
    ) -> RouterMetrics:
        counts = stats.counts.sum(1)
        if metrics is None:
            return RouterMetrics(
                aux.detach(), z.detach(), counts, tuple(self.model.args.moe_layers), self.options.router
            )
        metrics.aux_loss = metrics.aux_loss + aux.detach()
        metrics.z_loss = metrics.z_loss + z.detach()
        metrics.counts = metrics.counts + counts
        return metrics

    @torch.no_grad()
    def forward(self, samples: list[Sample], with_entropy: bool = False) -> ForwardResult:
        """Per-token log-probabilities of each sample's labels (and entropies), in the samples' order."""
        logprobs: list[torch.Tensor] = []
        entropies: list[torch.Tensor] = []
        cp_mesh = self.parallel_dims.mesh("cp")
        for mb in self._microbatches(samples)[1]:
            mb = mb.to(self.device)
            with self._autocast():
                hidden, _ = self._hidden(mb)
                mb_logprobs, mb_entropy = token_logprobs(
                    hidden,
                    self.model.output.weight,
                    mb.labels,
                    self.options.logits_chunk_size,
                    with_entropy=with_entropy,
                    **self._logprob_options(),
                )
            per_token = torch.stack([v for v in (mb_logprobs, mb_entropy) if v is not None], 1)
            if mb.is_padding:
                continue
            if cp_mesh is not None:
                # Per-token scalars only (never logits), and only outside training.
                per_token = gather_from_cp_ranks(per_token, mb.cp_layout, cp_mesh)
            per_seq = per_token[: sum(mb.seq_lens)].cpu().split(mb.seq_lens)
            logprobs.extend(values[:, 0] for values in per_seq)
            entropies.extend(values[:, -1] for values in per_seq)
        # The root (and, under the "default" and "never" policies, blocks) keep their parameters
        # gathered after forward for the backward that usually follows; with no backward,
        # release every group so that an optimizer step cannot leave a stale gathered copy
        # behind (and ``parameters()`` yields the sharded ones again).
        reshard(self.model)
        return ForwardResult(logprobs, entropies if with_entropy else None)

    def optim_step(self) -> dict[str, torch.Tensor | float]:
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.options.max_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}


def _max_sequence_mean_loss(mb: MicroBatch, token_losses: torch.Tensor, cp_mesh) -> torch.Tensor:
    """Largest mean loss over the loss tokens of one sequence, among this micro-batch's
    sequences with loss tokens (-inf if none has any; RL losses can be negative).

    Under context parallel each rank holds part of every sequence: the per-sequence sums
    and counts are summed over ``cp`` before dividing.
    """
    mask = mb.loss_mask.to(token_losses.dtype)
    per_seq = torch.zeros(2, mb.num_seqs, device=token_losses.device)
    per_seq[0].index_add_(0, mb.seq_ids, token_losses * mask)
    per_seq[1].index_add_(0, mb.seq_ids, mask)
    per_seq_sum, per_seq_count = all_reduce(per_seq, "sum", cp_mesh)
    means = per_seq_sum / per_seq_count.clamp(min=1)
    return torch.where(per_seq_count > 0, means, -torch.inf).max()
