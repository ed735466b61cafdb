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


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str, every: int = 1) -> None:
    """Recompute the activations of every block (``full``) or of every ``every``-th block
    (``selective``) in backward instead of keeping them."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode: {mode!r} is not one of {', '.join(AC_MODES)}")
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if mode == "full" or i % every == 0:
            # Non-reentrant: works with inputs that need no gradient and with FSDP2's hooks,
            # which unshard the block's parameters again before its recomputation in backward.
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
