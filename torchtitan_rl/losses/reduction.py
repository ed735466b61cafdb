"""Reduction modes as per-token weights computed from global mini-batch counts (docs/design.md, 'Loss weights').

This is the only place that normalizes a loss. Every loss is ``Σ_t w_t · ℓ_t`` over the
tokens a rank holds, and gradients are summed over micro-batches and ranks, so the result
equals the single-process full-batch loss of the chosen mode for any parallel layout
(except ``token_mean_legacy``, which reproduces the layout-dependent behaviour on purpose).
"""

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_rl.data.packing import MicroBatch
from torchtitan_rl.distributed.utils import all_reduce

REDUCTION_MODES = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "sum", "token_mean_legacy", "prompt_mean")
# Modes whose weights need each sample's prompt group (``Sample.group_id``).
GROUPED_MODES = ("prompt_mean",)

# Layout of the count vector gathered in the step's single all-reduce; with prompt groups,
# the loss tokens of group g follow at GROUP_LOSS_TOKENS + g. NUM_TOKENS counts real tokens
# (padding never), NUM_SEQS and NUM_MICROBATCHES all sequences and non-filler micro-batches
# (the router losses' sequence and micro-batch scopes average over them).
(
    NUM_LOSS_TOKENS,
    NUM_SEQS_WITH_LOSS,
    NUM_MICROBATCHES_WITH_LOSS,
    NUM_TOKENS,
    SUM_SQUARED_SEQ_LENS,
    NUM_SEQS,
    NUM_MICROBATCHES,
) = range(7)
GROUP_LOSS_TOKENS = 7


def local_counts(microbatches: list[MicroBatch], num_groups: int = 0) -> torch.Tensor:
    """This rank's counts, from host tensors (no device work, no sync).

    ``num_groups`` > 0 appends the loss tokens of every prompt group 0..num_groups-1 (the
    micro-batches then carry ``group_ids``).
    """
    counts = torch.zeros(GROUP_LOSS_TOKENS + num_groups, dtype=torch.int64)
    for mb in microbatches:
        if mb.is_padding:
            continue
        num_loss = int(mb.loss_mask.sum())
        per_seq = torch.zeros(mb.num_seqs, dtype=torch.int64).index_add_(0, mb.seq_ids, mb.loss_mask.long())
        counts[NUM_LOSS_TOKENS] += num_loss
        counts[NUM_SEQS_WITH_LOSS] += int((per_seq > 0).sum())
        counts[NUM_MICROBATCHES_WITH_LOSS] += int(num_loss > 0)
        counts[NUM_TOKENS] += mb.num_tokens - mb.num_padding_tokens
        counts[SUM_SQUARED_SEQ_LENS] += sum(n * n for n in mb.seq_lens)
        counts[NUM_SEQS] += len(mb.seq_lens)
        counts[NUM_MICROBATCHES] += 1
        if num_groups:
            counts[GROUP_LOSS_TOKENS:].index_add_(0, mb.group_ids, mb.loss_mask.long())
    return counts


def global_counts(counts: torch.Tensor, batch_mesh: DeviceMesh | None, device: torch.device) -> torch.Tensor:
    """This rank's ``local_counts`` summed over every rank that loads different samples;
    stays on ``device`` (no host sync).

    A prompt group whose samples sit on several DP ranks gets its loss tokens summed here,
    so its count is that of the whole group.
    """
    return all_reduce(counts.to(device, non_blocking=True), "sum", batch_mesh)


def token_weights(mb: MicroBatch, mode: str, counts: torch.Tensor, horizon: int) -> torch.Tensor:
    """``w_t`` for every token of a (device-resident) micro-batch, float32.

    Denominators are clamped to >= 1: a count of 0 means no token has a non-zero mask, so
    the weights are 0 either way and never NaN. A micro-batch carrying ``loss_weights`` (the
    loss reads them) has each token's weight multiplied by its own: still a per-token factor,
    so the layout cannot change it.
    """
    mask = mb.loss_mask.to(torch.float32)
    if mb.loss_weights is not None:
        mask = mask * mb.loss_weights
    if mode == "sum":
        return mask
    if mode == "token_mean":
        return mask / counts[NUM_LOSS_TOKENS].clamp(min=1)
    num_seqs = counts[NUM_SEQS_WITH_LOSS].clamp(min=1)
    if mode == "sequence_mean":
        return mask / (mb.seq_num_loss_tokens.clamp(min=1) * num_seqs)
    if mode == "seq_mean_token_sum_norm":
        return mask / (horizon * num_seqs)
    if mode == "token_mean_legacy":
        # The whole micro-batch's count, so a CP share normalizes like the whole micro-batch.
        return mask / (max(mb.num_loss_tokens, 1) * counts[NUM_MICROBATCHES_WITH_LOSS].clamp(min=1))
    if mode == "prompt_mean":
        assert mb.group_ids is not None and counts.numel() > GROUP_LOSS_TOKENS, "prompt_mean needs group counts"
        group_loss_tokens = counts[GROUP_LOSS_TOKENS:]
        num_groups = (group_loss_tokens > 0).sum().clamp(min=1)
        return mask / (group_loss_tokens[mb.group_ids].clamp(min=1) * num_groups)
    raise ValueError(f"unknown loss.reduction {mode!r}; valid modes: {', '.join(REDUCTION_MODES)}")
