"""The training engine: micro-batching, weighted losses, gradient accumulation, optimizer.

Trainers hand it the rank's share of a mini-batch; it knows meshes, devices and
micro-batches (DESIGN §7). Gradients of successive ``forward_backward`` calls add up
until ``optim_step`` (Tinker semantics).
"""

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtitan_rl.data.packing import MicroBatch, build_microbatches, plan_microbatches
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.distributed.context_parallel import gather_from_cp_ranks, shard_microbatch
from torchtitan_rl.distributed.utils import all_reduce, host_max
from torchtitan_rl.losses.logprobs import token_logprobs
from torchtitan_rl.losses.reduction import global_counts, token_weights

LOSS_FNS = ("cross_entropy",)


@dataclass
class ForwardBackwardMetrics:
    """Device-resident results of one ``forward_backward``; reduced only when logged."""

    loss: torch.Tensor  # this rank's Σ w·ℓ (sum over the `loss` mesh = mini-batch loss)
    max_seq_loss: torch.Tensor  # largest per-sequence mean loss among this rank's sequences
    counts: torch.Tensor  # global counts, see losses.reduction


@dataclass
class EngineOptions:
    reduction: str
    horizon: int
    max_tokens_per_microbatch: int
    logits_chunk_size: int
    max_norm: float
    loss_parallel: bool = True


class Engine:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
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

    def _microbatches(self, samples: list[Sample]) -> tuple[list[MicroBatch], list[MicroBatch]]:
        """The rank's plan as whole micro-batches (for counts) and as this rank's shares.

        Every rank runs the same number of passes. Without context parallel the shares are
        the whole micro-batches; with it, each CP rank keeps its zigzag share of every one.
        """
        dims = self.parallel_dims
        plan = plan_microbatches([len(s) for s in samples], self.options.max_tokens_per_microbatch)
        num_microbatches = max(1, host_max(len(plan), dims.mesh("batch")))
        cp_mesh = dims.mesh("cp")
        if cp_mesh is None:
            # Sequence parallel shards every micro-batch's tokens evenly over the TP ranks.
            whole = build_microbatches(samples, plan, num_microbatches, pad_multiple=dims.tp)
            return whole, whole
        # The CP split pads every sequence so that each rank's share divides by tp.
        whole = build_microbatches(samples, plan, num_microbatches)
        rank = cp_mesh.get_local_rank()
        return whole, [shard_microbatch(mb, dims.cp, rank, multiple=dims.tp) for mb in whole]

    def _token_losses(self, mb: MicroBatch) -> torch.Tensor:
        """Per-token cross-entropy ``[T]`` of a device-resident micro-batch."""
        with self._autocast():
            hidden = self.model(mb.input_ids, mb.positions, mb.seq_ids)
            logprobs, _ = token_logprobs(
                hidden,
                self.model.output.weight,
                mb.labels,
                self.options.logits_chunk_size,
                tp_mesh=self.parallel_dims.mesh("tp"),
                loss_parallel=self.options.loss_parallel,
            )
        return -logprobs

    def forward_backward(self, samples: list[Sample], loss_fn: str = "cross_entropy") -> ForwardBackwardMetrics:
        if loss_fn not in LOSS_FNS:
            raise ValueError(f"unknown loss_fn {loss_fn!r}; available: {', '.join(LOSS_FNS)}")
        whole, microbatches = self._microbatches(samples)
        # Counts come from whole sequences: a CP share would miscount n_i and B.
        counts = global_counts(whole, self.parallel_dims.mesh("batch"), self.device)
        cp_mesh = self.parallel_dims.mesh("cp")
        loss_total = torch.zeros((), device=self.device)
        max_seq_loss = torch.zeros((), device=self.device)
        for i, mb in enumerate(microbatches):
            mb = mb.to(self.device)
            if isinstance(self.model, FSDPModule):
                # Accumulate unsharded gradients locally; reduce-scatter their sum once.
                self.model.set_requires_gradient_sync(i == len(microbatches) - 1)
            token_losses = self._token_losses(mb)
            weights = token_weights(mb, self.options.reduction, counts, self.options.horizon)
            loss = (token_losses * weights).sum()
            loss.backward()
            loss_total += loss.detach()
            max_seq_loss = torch.maximum(max_seq_loss, _max_sequence_mean_loss(mb, token_losses.detach(), cp_mesh))
        return ForwardBackwardMetrics(loss=loss_total, max_seq_loss=max_seq_loss, counts=counts)

    @torch.no_grad()
    def forward(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-token log-probabilities of each sample's labels, in the samples' order."""
        logprobs: list[torch.Tensor] = []
        cp_mesh = self.parallel_dims.mesh("cp")
        for mb in self._microbatches(samples)[1]:
            per_token = -self._token_losses(mb.to(self.device))
            if mb.is_padding:
                continue
            if cp_mesh is not None:
                # Per-token scalars only (never logits), and only outside training.
                per_token = gather_from_cp_ranks(per_token, mb.cp_layout, cp_mesh)
            logprobs.extend(per_token[: sum(mb.seq_lens)].split(mb.seq_lens))
        if isinstance(self.model, FSDPModule):
            # The root keeps its parameters gathered after forward for the backward that
            # usually follows; with no backward, release them so an optimizer step cannot
            # leave a stale gathered copy behind.
            self.model.reshard()
        return logprobs

    def optim_step(self) -> dict[str, torch.Tensor | float]:
        grad_norm = clip_grad_norm_(list(self.model.parameters()), self.options.max_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}


def _max_sequence_mean_loss(mb: MicroBatch, token_losses: torch.Tensor, cp_mesh) -> torch.Tensor:
    """Largest mean loss over the loss tokens of one sequence, among this micro-batch's.

    Under context parallel each rank holds part of every sequence: the per-sequence sums
    and counts are summed over ``cp`` before dividing.
    """
    mask = mb.loss_mask.to(token_losses.dtype)
    per_seq = torch.zeros(2, mb.num_seqs, device=token_losses.device)
    per_seq[0].index_add_(0, mb.seq_ids, token_losses * mask)
    per_seq[1].index_add_(0, mb.seq_ids, mask)
    per_seq_sum, per_seq_count = all_reduce(per_seq, "sum", cp_mesh)
    return (per_seq_sum / per_seq_count.clamp(min=1)).max()
