"""The unit of data every later stage works on: one tokenized, already-shifted sequence."""

import math
from dataclasses import dataclass

import torch

# Optional per-token RL inputs of a sample, each aligned with ``labels`` (value t belongs to
# the prediction of labels[t]), float32.
RL_TOKEN_INPUTS = ("advantages", "sampler_logprobs", "ref_logprobs")
# Samplers in bf16 report log-probs a hair above 0 for near-certain tokens; anything larger is
# not a log-probability (e.g. probabilities or logits passed by mistake).
_MAX_LOGPROB = math.log1p(1e-2)


@dataclass
class Sample:
    """One training sequence, shifted for next-token prediction.

    ``labels[t]`` is the token that follows ``input_ids[t]``; ``loss_mask[t]`` says whether
    predicting it counts in the loss. Built per sequence so that no label ever crosses into
    another sequence once samples are packed together.

    RL samples (Tinker's ``Datum``) also carry, aligned with ``labels``: ``advantages``,
    ``sampler_logprobs`` (log-probs of the policy that sampled the tokens, "old") and
    ``ref_logprobs`` (a frozen reference policy), and the index ``group_id`` of their prompt
    group in the mini-batch. All travel with the labels through packing and every split.
    """

    input_ids: torch.Tensor  # [n] int64
    labels: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] bool
    advantages: torch.Tensor | None = None  # [n] float
    sampler_logprobs: torch.Tensor | None = None  # [n] float
    ref_logprobs: torch.Tensor | None = None  # [n] float
    group_id: int | None = None

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


def find_input_problem(samples: list[Sample], needed: tuple[str, ...]) -> str | None:
    """The first reason the ``needed`` inputs (names of ``RL_TOKEN_INPUTS`` or ``group_id``)
    of ``samples`` cannot be used, or None.

    Non-finite values are refused everywhere, loss mask or not: a NaN multiplied by a zero
    weight is still NaN.
    """
    for i, sample in enumerate(samples):
        for name in needed:
            value = getattr(sample, name)
            where = f"sample {i} of this rank's {len(samples)}"
            if value is None:
                return f"{where} has no {name}"
            if name == "group_id":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    return f"{where}: group_id must be an int >= 0 (the prompt group's index), got {value!r}"
                continue
            if not isinstance(value, torch.Tensor) or value.shape != sample.labels.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                return f"{where}: {name} must be a tensor of shape {tuple(sample.labels.shape)} (one value per label), got {shape}"
            if not value.is_floating_point():
                return f"{where}: {name} must be floating point, got {value.dtype}"
            finite = torch.isfinite(value)
            if not bool(finite.all()):
                t = int((~finite).nonzero()[0])
                return f"{where}: {name}[{t}] = {float(value[t])} is not finite (use 0 where the loss mask is 0)"
            if name.endswith("logprobs") and float(value.max()) > _MAX_LOGPROB:
                t = int(value.argmax())
                return f"{where}: {name}[{t}] = {float(value[t]):.4g} is a log-probability above 0"
    return None
