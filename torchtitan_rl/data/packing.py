"""Micro-batch plan: pack a rank's samples into token-budgeted, batch-free micro-batches."""

from dataclasses import dataclass, replace

import torch

from torchtitan_rl.data.sample import Sample


@dataclass
class MicroBatch:
    """Several sequences folded into one token dimension ``[T]``.

    ``seq_ids`` names each token's sequence (0..num_seqs-1 inside this micro-batch) and
    ``positions`` restart at 0 for every sequence: together they define the
    document-causal attention mask. ``seq_num_loss_tokens[t]`` is ``n_i`` of the token's
    sequence, counted on the whole (unsplit) sequence, as reduction weights need it.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor
    seq_num_loss_tokens: torch.Tensor
    seq_lens: list[int]  # the real sequences, in order; padding tokens come after them
    # True for the zero-weight filler every rank runs so all ranks do the same number
    # of forward/backward passes (FSDP collectives would otherwise deadlock).
    is_padding: bool = False
    # Zero-weight tokens appended so the token count divides what sequence parallel needs;
    # they form one extra pseudo-sequence of their own, invisible to real tokens.
    num_padding_tokens: int = 0
    # Loss tokens of the whole micro-batch; stays that of the whole one after a CP split
    # (token_mean_legacy normalizes by it).
    num_loss_tokens: int = 0
    # Set on a context-parallel share: how the whole micro-batch was split
    # (distributed.context_parallel.ZigzagLayout); None for a whole micro-batch.
    cp_layout: object | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        """Distinct ``seq_ids`` in the buffer, the padding pseudo-sequence included."""
        return len(self.seq_lens) + (1 if self.num_padding_tokens else 0)

    def to(self, device: torch.device) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return replace(
            self,
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            loss_mask=move(self.loss_mask),
            positions=move(self.positions),
            seq_ids=move(self.seq_ids),
            seq_num_loss_tokens=move(self.seq_num_loss_tokens),
        )


def plan_microbatches(seq_lens: list[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices, in order, into micro-batches of at most ``max_tokens`` tokens.

    ``max_tokens == 0`` means no budget: everything goes into one micro-batch. Order is
    kept so the plan is a pure function of the data (every rank can reason about it).
    """
    if not seq_lens:
        return []
    if max_tokens == 0:
        return [list(range(len(seq_lens)))]
    plan: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(seq_lens):
        if n > max_tokens:
            raise ValueError(
                f"a sample of {n} tokens exceeds training.max_tokens_per_microbatch={max_tokens}"
            )
        if current and used + n > max_tokens:
            plan.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    plan.append(current)
    return plan


def pack(samples: list[Sample], pad_multiple: int = 1) -> MicroBatch:
    """Concatenate samples into one micro-batch; labels stay those built per sequence.

    The token count is padded up to a multiple of ``pad_multiple`` (sequence parallel
    shards the token dim evenly) with zero-weight tokens forming their own sequence.
    """
    assert samples, "pack() needs at least one sample; use padding_microbatch() for none"
    seq_lens = [len(s) for s in samples]
    num_padding = -sum(seq_lens) % pad_multiple
    lens = seq_lens + ([num_padding] if num_padding else [])
    pad = torch.zeros(num_padding, dtype=torch.long)
    return MicroBatch(
        input_ids=torch.cat([s.input_ids for s in samples] + [pad]),
        labels=torch.cat([s.labels for s in samples] + [pad]),
        loss_mask=torch.cat([s.loss_mask for s in samples] + [pad.bool()]),
        positions=torch.cat([torch.arange(n) for n in lens]),
        seq_ids=torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)),
        seq_num_loss_tokens=torch.cat(
            [torch.full((len(s),), s.num_loss_tokens, dtype=torch.long) for s in samples] + [pad]
        ),
        seq_lens=seq_lens,
        num_padding_tokens=num_padding,
        num_loss_tokens=sum(s.num_loss_tokens for s in samples),
    )


def padding_microbatch(num_tokens: int = 1) -> MicroBatch:
    """A micro-batch with no loss token: runs the model, contributes nothing."""
    zeros = torch.zeros(num_tokens, dtype=torch.long)
    return MicroBatch(
        input_ids=zeros,
        labels=zeros.clone(),
        loss_mask=torch.zeros(num_tokens, dtype=torch.bool),
        positions=torch.arange(num_tokens),
        seq_ids=zeros.clone(),
        seq_num_loss_tokens=zeros.clone(),
        seq_lens=[],
        is_padding=True,
        num_padding_tokens=num_tokens,
    )


def build_microbatches(
    samples: list[Sample], plan: list[list[int]], num_microbatches: int, pad_multiple: int = 1
) -> list[MicroBatch]:
    """Pack ``samples`` by ``plan`` (see plan_microbatches), then pad with filler up to ``num_microbatches``."""
    assert len(plan) <= num_microbatches
    packed = [pack([samples[i] for i in group], pad_multiple) for group in plan]
    return packed + [padding_microbatch(pad_multiple) for _ in range(num_microbatches - len(plan))]
