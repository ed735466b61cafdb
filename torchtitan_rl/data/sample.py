"""The unit of data every later stage works on: one tokenized, already-shifted sequence."""

import math
from dataclasses import dataclass

import torch

# Optional per-token inputs of a sample that losses read (RL's, the per-token weights and GSPO
# ratio masks of a caller that weighs tokens itself, a critic's value targets), each aligned with
# ``labels`` (value t belongs to the prediction of labels[t]), float32.
RL_TOKEN_INPUTS = (
    "advantages",
    "sampler_logprobs",
    "prox_logprobs",
    "rollout_weights",
    "ref_logprobs",
    "loss_weights",
    "ratio_mask",
    "returns",
    "old_values",
)
# Samplers in bf16 report log-probs a hair above 0 for near-certain tokens; anything larger is
# not a log-probability (e.g. probabilities or logits passed by mistake).
MAX_LOGPROB = math.log1p(1e-2)
_TOKEN_FIELDS = ("input_ids", "labels", "loss_mask", *RL_TOKEN_INPUTS, "vision_rows", "routed_experts")


@dataclass
class SampleImage:
    """One image of a sample, resized, normalized and cut into patches (``data.images``).

    ``patches[r * cols + c]`` is the patch at row r, column c of the ``rows x cols`` grid,
    flattened channel-major (C, p, p), the layout a Conv2d patch embedding's weight has.
    """

    patches: torch.Tensor  # [rows * cols, C * p * p] float32
    rows: int
    cols: int

    @property
    def num_patches(self) -> int:
        return self.rows * self.cols


@dataclass
class Sample:
    """One training sequence, shifted for next-token prediction.

    ``labels[t]`` is the token that follows ``input_ids[t]``; ``loss_mask[t]`` says whether
    predicting it counts in the loss. Built per sequence so that no label ever crosses into
    another sequence once samples are packed together.

    RL samples (Tinker's ``Datum``) also carry, aligned with ``labels``: ``advantages``,
    ``sampler_logprobs`` (log-probs of the policy that sampled the tokens: the behaviour
    policy, never overwritten), ``prox_logprobs`` (the proximal policy's, recomputed by the
    trainer before an update when the recipe needs them), ``rollout_weights`` (each token's
    rollout-correction weight, >= 0) and ``ref_logprobs`` (a frozen reference policy), and the
    index ``group_id`` of their prompt group in the mini-batch. A caller that weighs tokens
    itself (the Tinker service) also gives ``loss_weights`` (a factor of each token's loss, any
    sign) and, for GSPO, ``ratio_mask`` (non-zero on the tokens whose log-ratios the sequence
    ratio averages); each is read only by a loss configured to (``losses.loss_fns``,
    ``PROGRAM_OPTIONS``). All travel with the labels through packing and every split.

    Every tensor of a sample lives on the CPU: planning, packing and the context-parallel split
    run on the host, and the engine moves whole micro-batches to the device.
    """

    input_ids: torch.Tensor  # [n] int64
    labels: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] bool
    advantages: torch.Tensor | None = None  # [n] float
    sampler_logprobs: torch.Tensor | None = None  # [n] float
    prox_logprobs: torch.Tensor | None = None  # [n] float
    rollout_weights: torch.Tensor | None = None  # [n] float
    ref_logprobs: torch.Tensor | None = None  # [n] float
    loss_weights: torch.Tensor | None = None  # [n] float
    ratio_mask: torch.Tensor | None = None  # [n] float, non-zero = in the sequence ratio
    # PPO with a critic: each token's value target (the GAE return, ``rl.gae``) and the critic's
    # value before the update (what value clipping holds the new one near).
    returns: torch.Tensor | None = None  # [n] float
    old_values: torch.Tensor | None = None  # [n] float
    group_id: int | None = None
    # Preference pairs: True for the chosen completion of pair ``group_id``, False for the
    # rejected one; None otherwise.
    preferred: bool | None = None
    # Preference pairs: the pair's margin (its row's ``margin`` column, 0 without one), the same
    # on both sides; a reward model's loss wants the chosen score above the rejected one by it.
    margin: float = 0.0
    # RL: the version of the weights that sampled the completion (the RL step they are from),
    # which tells the sampler/trainer mismatch apart from staleness (``rl/*_logprob_diff_*``).
    sampler_version: int | None = None
    # Vision-language samples: the sample's images in order, and per input token the row of
    # the sample's vision features (its images' merged patches, concatenated in order) that
    # replaces the token's embedding, or -1. Image placeholder tokens are never loss tokens.
    images: list[SampleImage] | None = None
    vision_rows: torch.Tensor | None = None  # [n] int64, aligned with input_ids
    # MoE RL with routing replay: per input token and MoE layer, the top-k experts the sampler
    # routed it to (int16, -1 where none was recorded: the trainer routes that token itself).
    routed_experts: torch.Tensor | None = None  # [n, MoE layers, top_k], aligned with input_ids
    # RL: what the rollout dump keeps of the rollout the sample came from (its group, reward,
    # stop reason, ...: ``rl/rollout_dump.py``); no loss reads it.
    rollout_info: dict | None = None

    @classmethod
    def from_tokens(cls, tokens: list[int], target_mask: list[bool]) -> "Sample":
        """``target_mask[j]`` says whether token ``j`` is a token the model should learn to emit."""
        assert len(tokens) == len(target_mask) and len(tokens) >= 2
        ids = torch.tensor(tokens, dtype=torch.long)
        mask = torch.tensor(target_mask, dtype=torch.bool)
        return cls(input_ids=ids[:-1], labels=ids[1:].clone(), loss_mask=mask[1:].clone())

    def __len__(self) -> int:
        return self.input_ids.numel()

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_patches(self) -> int:
        return sum(image.num_patches for image in self.images or ())


def find_input_problem(samples: list[Sample], needed: tuple[str, ...]) -> str | None:
    """A reason the ``needed`` inputs (names of ``RL_TOKEN_INPUTS`` or ``group_id``) of
    ``samples`` cannot be used, or None: the first sample's with a missing input or one of the
    wrong kind, else the first sample's with a bad value.

    Non-finite values are refused everywhere, loss mask or not: a NaN multiplied by a zero
    weight is still NaN.
    """
    where = lambda i: f"sample {i} of this rank's {len(samples)}"  # noqa: E731
    for i, sample in enumerate(samples):
        for name in _TOKEN_FIELDS:
            value = getattr(sample, name)
            if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                return f"{where(i)}: {name} is on {value.device}; a sample's tensors live on the CPU (see Sample)"
        for name in needed:
            value = getattr(sample, name)
            if value is None:
                return f"{where(i)} has no {name}"
            if name == "group_id":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    return f"{where(i)}: group_id must be an int >= 0 (the prompt group's index), got {value!r}"
                continue
            if not isinstance(value, torch.Tensor) or value.shape != sample.labels.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                return f"{where(i)}: {name} must be a tensor of shape {tuple(sample.labels.shape)} (one value per label), got {shape}"
            if not value.is_floating_point():
                return f"{where(i)}: {name} must be floating point, got {value.dtype}"
    # The values of all samples at once (a check per sample costs more than the checks); only a
    # bad batch is searched sample by sample for the culprit.
    for name in needed:
        if (
            name == "group_id"
            or not samples
            or _value_problem(name, torch.cat([getattr(s, name) for s in samples])) is None
        ):
            continue
        for i, sample in enumerate(samples):
            problem = _value_problem(name, getattr(sample, name))
            if problem is not None:
                return f"{where(i)}: {problem}"
    return None


def _value_problem(name: str, value: torch.Tensor) -> str | None:
    """Why the values of input ``name`` cannot be used, naming the first bad position; or None."""
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        t = int((~finite).nonzero()[0])
        return f"{name}[{t}] = {float(value[t])} is not finite (use 0 where the loss mask is 0)"
    if name == "rollout_weights" and float(value.min()) < 0:
        t = int(value.argmin())
        return f"rollout_weights[{t}] = {float(value[t]):.4g} is negative (a weight is >= 0; 0 masks)"
    if name.endswith("logprobs") and float(value.max()) > MAX_LOGPROB:
        t = int(value.argmax())
        return f"{name}[{t}] = {float(value[t]):.4g} is a log-probability above 0"
    return None


def find_vision_problem(samples: list[Sample], patch_dim: int | None, merge_size: int) -> str | None:
    """The first reason the images of ``samples`` cannot be used, or None.

    ``patch_dim`` is the model's patch vector length (C * p * p), None for a text model.
    Every feature row of a sample's images must replace exactly one of its tokens.
    """
    for i, sample in enumerate(samples):
        where = f"sample {i} of this rank's {len(samples)}"
        if not sample.images:
            if sample.vision_rows is not None and bool((sample.vision_rows >= 0).any()):
                return f"{where} has vision_rows but no images"
            continue
        if patch_dim is None:
            return f"{where} has images, but the model has no vision tower (train a vision-language model.name)"
        num_features = 0
        for k, image in enumerate(sample.images):
            if image.rows % merge_size or image.cols % merge_size:
                return (
                    f"{where}: image {k} has a {image.rows}x{image.cols} patch grid, not a multiple of the "
                    f"merge size {merge_size}"
                )
            if tuple(image.patches.shape) != (image.num_patches, patch_dim):
                return (
                    f"{where}: image {k} has patches of shape {tuple(image.patches.shape)}, expected "
                    f"({image.num_patches}, {patch_dim})"
                )
            num_features += image.num_patches // (merge_size * merge_size)
        rows = sample.vision_rows
        if rows is None or rows.shape != sample.input_ids.shape:
            return f"{where}: vision_rows must be a tensor of shape {tuple(sample.input_ids.shape)} (one row per input token)"
        used = rows[rows >= 0].sort().values
        if not torch.equal(used, torch.arange(num_features)):
            return (
                f"{where}: its images give {num_features} feature rows, each of which must replace exactly one "
                f"image token, but vision_rows has {used.numel()} image tokens"
            )
    return None


def find_routing_problem(samples: list[Sample], num_layers: int, top_k: int, num_experts: int) -> str | None:
    """The first reason the recorded experts (``routed_experts``) of ``samples`` cannot be
    replayed by a model with ``num_layers`` MoE layers of ``num_experts`` experts, ``top_k`` per
    token (0 layers: a dense model), or None. A (token, layer) row is either all -1 (no record)
    or ``top_k`` distinct expert ids."""
    for i, sample in enumerate(samples):
        experts = sample.routed_experts
        if experts is None:
            continue
        where = f"sample {i} of this rank's {len(samples)}"
        if num_layers == 0:
            return f"{where} has routed_experts, but the model has no MoE layers"
        expected = (len(sample), num_layers, top_k)
        if experts.is_floating_point() or experts.is_complex() or tuple(experts.shape) != expected:
            return (
                f"{where}: routed_experts must be an integer tensor [tokens, MoE layers, top_k] = {expected}, "
                f"got {experts.dtype} {tuple(experts.shape)}"
            )
        experts = experts.long()
        unrecorded = (experts == -1).all(-1)
        ordered = experts.sort(-1).values
        valid = (ordered >= 0).all(-1) & (ordered < num_experts).all(-1) & (ordered.diff(dim=-1) != 0).all(-1)
        bad = ~(unrecorded | valid)
        if bool(bad.any()):
            t, layer = (int(v) for v in bad.nonzero()[0])
            return (
                f"{where}: routed_experts[{t}, {layer}] = {experts[t, layer].tolist()}: a row is {top_k} distinct "
                f"expert ids in [0, {num_experts}) or all -1 (not recorded)"
            )
    return None
