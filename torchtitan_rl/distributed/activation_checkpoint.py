"""Activation checkpointing, applied from outside the model.

It keeps the module tree, so parameter names (and with them init seeds, checkpoints and HF
names) are the same with or without it: a block's ``forward`` is replaced on the instance.
Applied before tensor parallel and FSDP2, which hook the blocks and their submodules, not
``forward``.
"""

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

AC_MODES = ("none", "full", "selective")


def checkpointed_positions(num_blocks: int, mode: str, every: int = 1) -> list[int]:
    """Which of ``num_blocks`` blocks (positions in forward order) ``mode`` recomputes: every
    one (``full``), every ``every``-th from the first (``selective``) or none."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode: {mode!r} is not one of {', '.join(AC_MODES)}")
    if mode == "none":
        return []
    return [i for i in range(num_blocks) if mode == "full" or i % every == 0]


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str, every: int = 1) -> None:
    """Recompute the activations of the blocks ``checkpointed_positions`` names in backward
    instead of keeping them."""
    for i in checkpointed_positions(len(blocks), mode, every):
        # Non-reentrant: works with inputs that need no gradient and with FSDP2's hooks,
        # which unshard the block's parameters again before its recomputation in backward.
        blocks[i].forward = functools.partial(checkpoint, blocks[i].forward, use_reentrant=False)
