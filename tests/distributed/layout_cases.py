"""Shared by the multi-rank worker and its pytest driver: the model, the data, the layouts.

Kept free of any reference computation: the references live in the test module.
"""

import torch

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs

SEED = 1234
GLOBAL_BATCH_SIZE = 8
HORIZON = 32
# 0 = one micro-batch per rank; 24 = the longest sample, forcing several per rank.
BUDGETS = (0, 24, 40)
LR = 1e-2
MAX_NORM = 0.05  # small enough that clipping really happens in the optimizer-step case


def model_args(tie_embeddings: bool = False) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48,
        tie_embeddings=tie_embeddings, max_seq_len=64, attn_backend="sdpa_dense",
    )


# Lengths are deliberately uneven; samples 2 and 3 have no loss token, so with dp=4 rank 1
# holds no loss token at all; sample 4 is a single token.
_LENGTHS = (23, 5, 17, 9, 1, 12, 24, 3)
_NO_LOSS = (2, 3)


def global_batch(variant: str) -> list[Sample]:
    """``uneven``: the batch above; ``other``: different data; ``no_loss``: zero loss tokens."""
    gen = torch.Generator().manual_seed({"uneven": 0, "other": 1, "no_loss": 2}[variant])
    samples = []
    for i, n in enumerate(_LENGTHS):
        ids = torch.randint(0, 61, (n,), generator=gen)
        labels = torch.randint(0, 61, (n,), generator=gen)
        prompt = int(torch.randint(0, n, (1,), generator=gen)) if n > 1 else 0
        mask = torch.arange(n) >= prompt  # loss on a suffix, like a chat completion
        if variant == "no_loss" or (variant == "uneven" and i in _NO_LOSS):
            mask = torch.zeros(n, dtype=torch.bool)
        samples.append(Sample(input_ids=ids, labels=labels, loss_mask=mask))
    return samples


def layouts(world_size: int) -> list[tuple[int, int]]:
    """(dp_replicate, dp_shard) layouts to check on this many ranks."""
    if world_size == 4:
        return [(1, 4), (2, 2), (4, 1)]
    return [(1, world_size)]
