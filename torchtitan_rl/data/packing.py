"""Pack a rank's samples into batch-free micro-batches by a plan (``data.balance.plan_microbatches``)."""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from torchtitan_rl.data.sample import RL_TOKEN_INPUTS, Sample, SampleImage


@dataclass(frozen=True)
class VisionPacking:
    """How micro-batches of a vision-language model carry images.

    ``patch_dim`` is the length of one patch vector (C * p * p) and ``merge_size`` the side of
    the square of patches the projector merges into one feature row.
    """

    patch_dim: int
    merge_size: int

    def dummy_image(self) -> SampleImage:
        """The smallest image, all zeros, that no token uses: a micro-batch without images
        still runs the vision tower once, so every rank's FSDP collectives match."""
        m = self.merge_size
        return SampleImage(torch.zeros(m * m, self.patch_dim), m, m)

    def num_features(self, image: SampleImage) -> int:
        return image.num_patches // (self.merge_size * self.merge_size)


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
    prox_logprobs: torch.Tensor | None = None
    rollout_weights: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None
    ratio_mask: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    # Vision-language micro-batches: per token the row of the micro-batch's vision features
    # that replaces its embedding, or -1 (-1 on padding too); every image's patches
    # (``SampleImage`` layout, images in order) and patch grids. Exactly one dummy image
    # when no sample has one. None / () for text models.
    vision_index: torch.Tensor | None = None
    # Set by the engine on a device-resident share for a loss with sequence ratios (GSPO):
    # each token's sequence-mean log-ratio over the whole sequence (every CP share), detached.
    seq_log_ratio: torch.Tensor | None = None
    image_patches: torch.Tensor | None = None
    image_grids: tuple[tuple[int, int], ...] = ()
    num_images: int = 0  # real images (the dummy is not counted)
    # MoE routing replay: per token the experts the sampler chose in each MoE layer ``[T, L, k]``
    # (int16, -1 where a token routes itself: other samples' tokens, padding); None when no
    # sample of the micro-batch carries them.
    routed_experts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        """Distinct ``seq_ids`` in the buffer, the padding pseudo-sequence included."""
        return len(self.seq_lens) + (1 if self.num_padding_tokens else 0)

    def real_token_mask(self) -> torch.Tensor:
        """True for the tokens of real sequences, False for padding of any kind: the filler
        pseudo-sequence (filler micro-batches, sequence-parallel padding) and, on a CP share,
        the zigzag padding, whose positions continue past its sequence's end."""
        num_real = len(self.seq_lens)
        lens = torch.tensor([*self.seq_lens, 0], device=self.positions.device)
        return (self.seq_ids < num_real) & (self.positions < lens[self.seq_ids.clamp(max=num_real)])

    def token_fields(self) -> dict[str, torch.Tensor]:
        """Every per-token tensor the data defines (``TOKEN_FIELDS`` that are set).

        ``positions`` and ``seq_ids`` are not among them: they follow from the segment
        lengths, which a split recomputes (padding continues its sequence's positions).
        """
        return {name: v for name in TOKEN_FIELDS if (v := getattr(self, name)) is not None}

    def map_tokens(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MicroBatch":
        """A copy with ``fn`` applied to every per-token tensor of ``token_fields``."""
        return replace(self, **{name: fn(v) for name, v in self.token_fields().items()})

    def to(self, device: torch.device) -> "MicroBatch":
        if self.input_ids.device == device:
            return self  # built where it runs (the CPU): nothing to copy
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        patches = None if self.image_patches is None else move(self.image_patches)
        return replace(
            self.map_tokens(move), positions=move(self.positions), seq_ids=move(self.seq_ids), image_patches=patches
        )


# Every per-token tensor of a micro-batch (from the samples, and the engine's seq_log_ratio): one list, so packing,
# the CP split and device moves treat labels and RL inputs alike.
TOKEN_FIELDS = (
    "input_ids",
    "labels",
    "loss_mask",
    "seq_num_loss_tokens",
    *RL_TOKEN_INPUTS,
    "group_ids",
    "vision_index",
    "seq_log_ratio",
    "routed_experts",
)
_ALWAYS = TOKEN_FIELDS[:4]
# The value padding tokens carry, where it is not 0.
TOKEN_PAD_VALUES = {"vision_index": -1, "routed_experts": -1}
# The optional sample inputs a loss may ask ``pack`` to carry.
OPTIONAL_INPUTS = (*RL_TOKEN_INPUTS, "group_id")


def pack(
    samples: list[Sample], pad_multiple: int = 1, inputs: tuple[str, ...] = (), vision: VisionPacking | None = None
) -> MicroBatch:
    """Concatenate samples into one micro-batch; labels stay those built per sequence.

    ``inputs`` names the optional inputs (``OPTIONAL_INPUTS``) to carry; every sample has
    them (see ``data.sample.find_input_problem``). The token count is padded up to a
    multiple of ``pad_multiple`` (sequence parallel shards the token dim evenly) with
    zero-weight tokens forming their own sequence. With ``vision`` the samples' images are
    packed too, and each sample's ``vision_rows`` are shifted past the feature rows of the
    images before it into the micro-batch's ``vision_index``.
    """
    assert samples, "pack() needs at least one sample; use padding_microbatch() for none"
    seq_lens = [len(s) for s in samples]
    num_padding = -sum(seq_lens) % pad_multiple
    lens = seq_lens + ([num_padding] if num_padding else [])
    columns = {name: [_token_values(s, name) for s in samples] for name in _sample_fields(inputs)}
    if vision is not None:
        columns["vision_index"], images = _vision_rows_and_images(samples, vision)
    if any(s.routed_experts is not None for s in samples):
        columns["routed_experts"] = _routed_experts(samples)
    packed = {
        name: torch.cat(
            parts
            + [torch.full((num_padding, *parts[0].shape[1:]), TOKEN_PAD_VALUES.get(name, 0), dtype=parts[0].dtype)]
        )
        for name, parts in columns.items()
    }
    mb = MicroBatch(
        **packed,
        positions=torch.cat([torch.arange(n) for n in lens]),
        seq_ids=torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)),
        seq_lens=seq_lens,
        num_padding_tokens=num_padding,
        num_loss_tokens=sum(s.num_loss_tokens for s in samples),
    )
    return _with_images(mb, images, vision) if vision is not None else mb


def _vision_rows_and_images(
    samples: list[Sample], vision: VisionPacking
) -> tuple[list[torch.Tensor], list[SampleImage]]:
    rows, images, offset = [], [], 0
    for sample in samples:
        sample_rows = sample.vision_rows if sample.vision_rows is not None else torch.full((len(sample),), -1)
        rows.append(torch.where(sample_rows >= 0, sample_rows + offset, -1))
        for image in sample.images or ():
            images.append(image)
            offset += vision.num_features(image)
    return rows, images


def _routed_experts(samples: list[Sample]) -> list[torch.Tensor]:
    """Each sample's recorded experts ``[n, L, k]`` (int16), -1 for a sample without a record."""
    shape = next(s.routed_experts for s in samples if s.routed_experts is not None).shape[1:]
    return [
        s.routed_experts.to(torch.int16)
        if s.routed_experts is not None
        else torch.full((len(s), *shape), -1, dtype=torch.int16)
        for s in samples
    ]


def _with_images(mb: MicroBatch, images: list[SampleImage], vision: VisionPacking) -> MicroBatch:
    run = images or [vision.dummy_image()]
    return replace(
        mb,
        image_patches=torch.cat([image.patches.to(torch.float32) for image in run]),
        image_grids=tuple((image.rows, image.cols) for image in run),
        num_images=len(images),
    )


def _sample_fields(inputs: tuple[str, ...]) -> list[str]:
    """The ``TOKEN_FIELDS`` a micro-batch carrying ``inputs`` fills from its samples."""
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


def padding_microbatch(
    num_tokens: int = 1, inputs: tuple[str, ...] = (), vision: VisionPacking | None = None
) -> MicroBatch:
    """A micro-batch with no loss token: runs the model (and the vision tower on the dummy
    image), contributes nothing."""
    dtypes = {"loss_mask": torch.bool, **{name: torch.float32 for name in RL_TOKEN_INPUTS}}
    fields = _sample_fields(inputs) + (["vision_index"] if vision is not None else [])
    mb = MicroBatch(
        **{
            name: torch.full((num_tokens,), TOKEN_PAD_VALUES.get(name, 0), dtype=dtypes.get(name, torch.long))
            for name in fields
        },
        positions=torch.arange(num_tokens),
        seq_ids=torch.zeros(num_tokens, dtype=torch.long),
        seq_lens=[],
        is_padding=True,
        num_padding_tokens=num_tokens,
    )
    return _with_images(mb, [], vision) if vision is not None else mb


def pad_microbatch(mb: MicroBatch, num_tokens: int) -> MicroBatch:
    """``mb`` lengthened to ``num_tokens`` with zero-weight tokens of its padding
    pseudo-sequence (a new one when it has none), so that micro-batches of different lengths
    take one shape (pipeline stages exchange fixed-shape activations). A whole micro-batch (not a context-parallel share)."""
    assert mb.cp_layout is None, "pad whole micro-batches only"
    extra = num_tokens - mb.num_tokens
    assert extra >= 0, (num_tokens, mb.num_tokens)
    if extra == 0:
        return mb
    start = mb.num_padding_tokens  # the padding sequence's positions continue
    return replace(
        mb,
        **{
            name: torch.cat((v, v.new_full((extra, *v.shape[1:]), TOKEN_PAD_VALUES.get(name, 0))))
            for name, v in mb.token_fields().items()
        },
        positions=torch.cat((mb.positions, torch.arange(start, start + extra))),
        seq_ids=torch.cat((mb.seq_ids, torch.full((extra,), len(mb.seq_lens), dtype=torch.long))),
        num_padding_tokens=mb.num_padding_tokens + extra,
    )


def build_microbatches(
    samples: list[Sample],
    plan: list[list[int]],
    num_microbatches: int,
    pad_multiple: int = 1,
    inputs: tuple[str, ...] = (),
    vision: VisionPacking | None = None,
) -> list[MicroBatch]:
    """Pack ``samples`` by ``plan`` (``data.balance.plan_microbatches``), then pad with filler up to ``num_microbatches``."""
    assert len(plan) <= num_microbatches
    packed = [pack([samples[i] for i in group], pad_multiple, inputs, vision) for group in plan]
    return packed + [padding_microbatch(pad_multiple, inputs, vision) for _ in range(num_microbatches - len(plan))]
