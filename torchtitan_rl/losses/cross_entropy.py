"""Weighted cross-entropy computed in token chunks.

Each chunk's logits are recomputed in backward (activation checkpointing), so neither the
forward nor the backward ever holds the full ``[T, vocab]`` float32 logits: memory is
bounded by ``chunk_size * vocab`` per micro-batch.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_token_losses(hidden: torch.Tensor, output: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    logits = output(hidden).float()
    return F.cross_entropy(logits, labels, reduction="none")


def token_cross_entropy(hidden: torch.Tensor, output: nn.Module, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Per-token cross-entropy ``[T]`` (differentiable), from final hidden states ``[T, D]``."""
    pieces = []
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        pieces.append(
            checkpoint(_chunk_token_losses, hidden[start:end], output, labels[start:end], use_reentrant=False)
        )
    return torch.cat(pieces)
