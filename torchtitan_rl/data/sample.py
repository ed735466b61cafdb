"""The unit of data every later stage works on: one tokenized, already-shifted sequence."""

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One training sequence, shifted for next-token prediction.

    ``labels[t]`` is the token that follows ``input_ids[t]``; ``loss_mask[t]`` says whether
    predicting it counts in the loss. Built per sequence so that no label ever crosses into
    another sequence once samples are packed together.
    """

    input_ids: torch.Tensor  # [n] int64
    labels: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] bool

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
