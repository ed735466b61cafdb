"""Micro-batch plan: pack a rank's samples into token-budgeted, batch-free micro-batches."""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from torchtitan_rl.data.sample import RL_TOKEN_INPUTS, Sample


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
    # RL inputs (data.sample.RL_TOKEN_INPUTS), float32, and each token's prompt group; None
    # unless the loss asked for them. Zero on padding.
    advantages: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        """Distinct ``seq_ids`` in the buffer, the padding pseudo-sequence included."""
        return len(self.seq_lens) + (1 if self.num_padding_tokens else 0)

    def map_tokens(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MicroBatch":
        """A copy with ``fn`` applied to every per-token tensor the data defines.

        ``positions`` and ``seq_ids`` are left alone: they follow from the segment lengths,
        which a split recomputes (padding continues its sequence's positions).
        """
        return replace(self, **{name: fn(v) for name in TOKEN_FIELDS if (v := getattr(self, name)) is not None})

    def to(self, device: torch.device) -> "MicroBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return replace(self.map_tokens(move), positions=move(self.positions), seq_ids=move(self.seq_ids))


# Every per-token tensor of a micro-batch that comes from the samples: one list, so packing,
# the CP split and device moves treat labels and RL inputs alike.
TOKEN_FIELDS = ("input_ids", "labels", "loss_mask", "seq_num_loss_tokens", *RL_TOKEN_INPUTS, "group_ids")
_ALWAYS = TOKEN_FIELDS[:4]
# The optional sample inputs a loss may ask ``pack`` to carry.
OPTIONAL_INPUTS = (*RL_TOKEN_INPUTS, "group_id")


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


def pack(samples: list[Sample], pad_multiple: int = 1, inputs: tuple[str, ...] = ()) -> MicroBatch:
    """Concatenate samples into one micro-batch; labels stay those built per sequence.

    ``inputs`` names the optional inputs (``OPTIONAL_INPUTS``) to carry; every sample has
    them (see ``data.sample.find_input_problem``). The token count is padded up to a
    multiple of ``pad_multiple`` (sequence parallel shards the token dim evenly) with
    zero-weight tokens forming their own sequence.
    """
    assert samples, "pack() needs at least one sample; use padding_microbatch() for none"
    seq_lens = [len(s) for s in samples]
    num_padding = -sum(seq_lens) % pad_multiple
    lens = seq_lens + ([num_padding] if num_padding else [])
    columns = {name: [_token_values(s, name) for s in samples] for name in _sample_fields(inputs)}
    packed = {name: torch.cat(parts + [torch.zeros(num_padding, dtype=parts[0].dtype)]) for name, parts in columns.items()}
    return MicroBatch(
        **packed,
        positions=torch.cat([torch.arange(n) for n in lens]),
        seq_ids=torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)),
        seq_lens=seq_lens,
        num_padding_tokens=num_padding,
        num_loss_tokens=sum(s.num_loss_tokens for s in samples),
    )


def _sample_fields(inputs: tuple[str, ...]) -> list[str]:
    """The ``TOKEN_FIELDS`` a micro-batch carrying ``inputs`` fills."""
    assert set(inputs) <= set(OPTIONAL_INPUTS), inputs
    wanted = {"group_ids" if name == "group_id" else name for name in inputs}
    return [name for name in TOKEN_FIELDS if name in _ALWAYS or name in wanted]


def _token_values(sample: Sample, name: str) -> torch.Tensor:
    """One sample's ``[n]`` values of the micro-batch field ``name``."""
    n = len(sample)
    if name == "seq_num_loss_tokens":
        return torch.full((n,), sample.num_loss_tokens, dtype=torch.long)
    if name == "group_ids":
        return torch.full((n,), sample.group_id, dtype=torch.long)
    if name in RL_TOKEN_INPUTS:
        return getattr(sample, name).to(torch.float32)
    return getattr(sample, name)


def padding_microbatch(num_tokens: int = 1, inputs: tuple[str, ...] = ()) -> MicroBatch:
    """A micro-batch with no loss token: runs the model, contributes nothing."""
    dtypes = {"loss_mask": torch.bool, **{name: torch.float32 for name in RL_TOKEN_INPUTS}}
    return MicroBatch(
        **{name: torch.zeros(num_tokens, dtype=dtypes.get(name, torch.long)) for name in _sample_fields(inputs)},
        positions=torch.arange(num_tokens),
        seq_ids=torch.zeros(num_tokens, dtype=torch.long),
        seq_lens=[],
        is_padding=True,
        num_padding_tokens=num_tokens,
    )


def build_microbatches(
    samples: list[Sample],
    plan: list[list[int]],
    num_microbatches: int,
    pad_multiple: int = 1,
    inputs: tuple[str, ...] = (),
) -> list[MicroBatch]:
    """Pack ``samples`` by ``plan`` (see plan_microbatches), then pad with filler up to ``num_microbatches``."""
    assert len(plan) <= num_microbatches
    packed = [pack([samples[i] for i in group], pad_multiple, inputs) for group in plan]
    return packed + [padding_microbatch(pad_multiple, inputs) for _ in range(num_microbatches - len(plan))]
