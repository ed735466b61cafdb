"""Micro-batch plan: pack a rank's samples into token-budgeted, batch-free micro-batches."""

from dataclasses import dataclass

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
    seq_lens: list[int]
    # True for the zero-weight filler every rank runs so all ranks do the same number
    # of forward/backward passes (FSDP collectives would otherwise deadlock).
    is_padding: bool = False

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def to(self, device: torch.device) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            loss_mask=move(self.loss_mask),
            positions=move(self.positions),
            seq_ids=move(self.seq_ids),
            seq_num_loss_tokens=move(self.seq_num_loss_tokens),
            seq_lens=self.seq_lens,
            is_padding=self.is_padding,
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


def pack(samples: list[Sample]) -> MicroBatch:
    """Concatenate samples into one micro-batch; labels stay those built per sequence."""
    assert samples, "pack() needs at least one sample; use padding_microbatch() for none"
    seq_lens = [len(s) for s in samples]
    return MicroBatch(
        input_ids=torch.cat([s.input_ids for s in samples]),
        labels=torch.cat([s.labels for s in samples]),
        loss_mask=torch.cat([s.loss_mask for s in samples]),
        positions=torch.cat([torch.arange(n) for n in seq_lens]),
        seq_ids=torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(seq_lens)),
        seq_num_loss_tokens=torch.cat(
            [torch.full((len(s),), s.num_loss_tokens, dtype=torch.long) for s in samples]
        ),
        seq_lens=seq_lens,
    )


def padding_microbatch() -> MicroBatch:
    """A one-token micro-batch with no loss token: runs the model, contributes nothing."""
    one = torch.zeros(1, dtype=torch.long)
    return MicroBatch(
        input_ids=one,
        labels=one.clone(),
        loss_mask=torch.zeros(1, dtype=torch.bool),
        positions=one.clone(),
        seq_ids=one.clone(),
        seq_num_loss_tokens=one.clone(),
        seq_lens=[1],
        is_padding=True,
    )


def build_microbatches(samples: list[Sample], max_tokens: int, num_microbatches: int) -> list[MicroBatch]:
    """Pack ``samples`` by the plan, then pad with filler up to ``num_microbatches``."""
    plan = plan_microbatches([len(s) for s in samples], max_tokens)
    assert len(plan) <= num_microbatches
    packed = [pack([samples[i] for i in group]) for group in plan]
    return packed + [padding_microbatch() for _ in range(num_microbatches - len(plan))]
