"""The engine of a reward model (``Qwen3ModelArgs.score_head``): one score per sequence, read at
its last token, and the gradient of a weighted sum of scores, exact under any layout.

A reward model's loss is nonlinear in the scores of whole sequences, so, as for the preference
losses (``recipes.dpo``), a step first takes every sequence's score with a gradient-free pass
(``scores``) and then trains on ``Σ_i c_i s_i`` with each sequence's coefficient
``c_i = ∂L/∂s_i`` (``score_backward``), whose gradient is the loss's.

A sequence's last token is on exactly one rank of its micro-batch's context- and
tensor-parallel peers (sequence parallel shards the tokens, context parallel the sequences):
each rank scores the last tokens it holds and contributes 0 for the others, so the scores are
a sum over ``cp_tp`` and the gradient of ``Σ_i c_i s_i`` is the sum of every rank's own
terms, which FSDP and the replicated score head's tensor-parallel reduction add up.
"""

import torch
from torch.distributed.fsdp import FSDPModule

from torchtitan_rl.data.packing import MicroBatch
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.fsdp import reshard
from torchtitan_rl.distributed.utils import all_reduce
from torchtitan_rl.engine import Engine
from torchtitan_rl.losses.loss_fns import ForwardBackwardMetrics, LossMetrics
from torchtitan_rl.losses.reduction import global_counts
from torchtitan_rl.models.attention import AttentionContext


def score_positions(seq_lens: list[int], positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """True at the last token of each of the ``seq_lens`` real sequences of a packed micro-batch
    or of any context-parallel share of it (a token is the last by its own position), where a
    reward model reads its score. Padding (a pseudo-sequence of its own, or positions past its
    sequence's end) never is."""
    num_real = len(seq_lens)
    last = torch.tensor([*(n - 1 for n in seq_lens), -1], device=positions.device)
    return positions == last[seq_ids.clamp(max=num_real)]


class ScoreEngine(Engine):
    """``Engine`` for a model with a score head instead of an LM head: ``scores`` and
    ``score_backward`` take the place of ``forward`` and ``forward_backward``."""

    def __init__(self, model, **kwargs):
        if kwargs["options"].router is not None:
            raise ValueError("a reward model with mixture-of-experts layers is not supported: use a dense flavor")
        super().__init__(model, **kwargs)

    @torch.no_grad()
    def scores(self, samples: list[Sample]) -> torch.Tensor:
        """Each sample's score (float64 ``[len(samples)]`` on the CPU, in the samples' order): the
        score head at its last input token. Collective over the training ranks."""
        batch = self._agree(self._prepare(samples, ()))
        partial = [
            self._sequence_scores(mb.to(self.device), attention) for mb, attention in zip(batch.shares, batch.attention)
        ]
        # The root keeps its parameters gathered after a forward; with no backward, release them.
        reshard(self.model)
        packed = torch.cat([torch.zeros(0, device=self.device), *partial])
        packed = all_reduce(packed, "sum", self.parallel_dims.mesh("cp_tp")).double().cpu()
        scores = torch.empty(len(samples), dtype=torch.float64)
        scores[batch.sample_order] = packed
        return scores

    def score_backward(self, samples: list[Sample], coefficients: torch.Tensor) -> ForwardBackwardMetrics:
        """Accumulate the gradient of ``Σ_i c_i s_i`` over this rank's samples (``coefficients``:
        ``c_i`` of each, in the samples' order). The metrics' loss is this rank's part of that
        sum (the parts sum to it over every rank); its counts are the mini-batch's. Collective."""
        if coefficients.shape != (len(samples),):
            raise ValueError(f"score_backward takes one coefficient per sample, got {tuple(coefficients.shape)}")
        batch = self._agree(self._prepare(samples, ()))
        counts = global_counts(batch.local_counts, self.parallel_dims.mesh("batch"), self.device)
        # Every rank runs as many passes (filler included) so that FSDP's collectives match.
        shares, attention = batch.shares, batch.attention
        # Per pass, the coefficients of its real sequences in packing order (filler has none).
        packed = coefficients.float()[batch.sample_order].split([len(mb.seq_lens) for mb in shares])
        values = []
        for i, (mb, mb_attention, mb_coefficients) in enumerate(zip(shares, attention, packed)):
            if isinstance(self.model, FSDPModule):
                # Accumulate unsharded gradients locally; reduce-scatter their sum once.
                self.model.set_requires_gradient_sync(i == len(shares) - 1)
            scores = self._sequence_scores(mb.to(self.device), mb_attention)
            objective = (scores * mb_coefficients.to(self.device)).sum()
            objective.backward()
            values.append(objective.detach())
        return ForwardBackwardMetrics(
            loss=torch.stack(values).sum(),
            max_seq_loss=torch.full((), -torch.inf, device=self.device),
            counts=counts,
            terms=LossMetrics(),
        )

    def _sequence_scores(self, mb: MicroBatch, attention: AttentionContext | None) -> torch.Tensor:
        """This rank's part of the score of each real sequence of the device-resident share
        ``mb`` (float32 ``[len(mb.seq_lens)]``): its last token's score where this rank's
        residual stream holds that token, else 0."""
        with self._autocast():
            hidden, _ = self._forward(mb, attention)
            token_scores = self.model.score(hidden)[:, 0].float()
        last = self.model.shard_tokens(score_positions(mb.seq_lens, mb.positions, mb.seq_ids))
        seq_ids = self.model.shard_tokens(mb.seq_ids)
        per_seq = torch.zeros(mb.num_seqs, device=self.device)
        per_seq = per_seq.index_add(0, seq_ids, torch.where(last, token_scores, 0.0))
        return per_seq[: len(mb.seq_lens)]
