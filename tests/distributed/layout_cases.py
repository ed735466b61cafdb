"""Shared by the multi-rank worker and its pytest driver: the model, the data, the layouts.

Kept free of any reference computation: the references live in the test module.
"""

import contextlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs

SEED = 1234
GLOBAL_BATCH_SIZE = 8
HORIZON = 32
# 0 = one micro-batch per rank; 24 = the longest sample, forcing several per rank.
BUDGETS = (0, 24, 40)
LR = 1e-2
MAX_NORM = 0.05  # small enough that clipping really happens in the optimizer-step case
# Adam's first step moves each weight by lr * g / (|g| + eps): with a tiny eps, gradients
# of ~1e-9 (float rounding of the layout shows there) would decide whole steps.
ADAM_EPS = 1e-4


VOCAB = 64


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole of ``t`` (gathered, a collective, when it is a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


@torch.no_grad()
def set_full_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``param`` (possibly sharded) the whole value ``value``, the same on every rank."""
    if isinstance(param, DTensor):
        value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def model_args(tie_embeddings: bool = False, attn_backend: str = "sdpa_dense") -> Qwen3ModelArgs:
    # Heads, KV heads (GQA 2:1), hidden units and vocabulary all divide by tp = 4.
    return Qwen3ModelArgs(
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        head_dim=8,
        hidden_dim=48,
        tie_embeddings=tie_embeddings,
        max_seq_len=64,
        attn_backend=attn_backend,
    )


# Layouts run with sdpa_dense (the reference backend: one boolean mask over the micro-batch)
# are also run with sdpa_varlen, the default CPU backend, on these composite layouts
# (dp_shard x cp, dp_shard x tp): CP shares and sequence-parallel shards through its planner.
VARLEN_LAYOUTS = ((1, 2, 2, 1), (1, 2, 1, 2))


# Lengths are deliberately uneven; samples 2 and 3 have no loss token, so with dp=4 rank 1
# holds no loss token at all; sample 4 is a single token. Sample 5 has loss tokens at
# positions 6..8 only, which the zigzag split puts on a single CP rank for cp = 2 and 4
# (also with tp = 2).
_LENGTHS = (23, 5, 17, 9, 1, 12, 24, 3)
_NO_LOSS = (2, 3)
MIDDLE_LOSS, MIDDLE_LOSS_POSITIONS = 5, range(6, 9)


def global_batch(variant: str) -> list[Sample]:
    """``uneven``: the batch above; ``other``: different data; ``no_loss``: zero loss tokens;
    ``rl``: ``uneven`` with RL inputs (``rl_batch``)."""
    if variant == "rl":
        return rl_batch()
    gen = torch.Generator().manual_seed({"uneven": 0, "other": 1, "no_loss": 2}[variant])
    samples = []
    for i, n in enumerate(_LENGTHS):
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        labels = torch.randint(0, VOCAB, (n,), generator=gen)
        prompt = int(torch.randint(0, n, (1,), generator=gen)) if n > 1 else 0
        mask = torch.arange(n) >= prompt  # loss on a suffix, like a chat completion
        if variant == "no_loss" or (variant == "uneven" and i in _NO_LOSS):
            mask = torch.zeros(n, dtype=torch.bool)
        if variant == "uneven" and i == MIDDLE_LOSS:
            mask = torch.isin(torch.arange(n), torch.tensor(MIDDLE_LOSS_POSITIONS))
        samples.append(Sample(input_ids=ids, labels=labels, loss_mask=mask))
    return samples


# RL: the "uneven" batch with per-token advantages, sampler and reference log-probs near the
# initial model's (≈ -log VOCAB, so ratios fall on both sides of every clip bound), and prompt
# groups of different sizes. Group 1 spans samples 1-4: split over the ranks of dp = 2 and 4,
# with loss tokens on both sides; group 2 (samples 5, 6) is split by dp = 4. Sample 6 has
# zero advantages.
RL_GROUPS = (0, 1, 1, 1, 1, 2, 2, 3)
RL_ZERO_ADVANTAGE = 6
RL_LOSS_FNS = {
    # Decoupled PPO: the ratio to the proximal log-probs, times the rollout-correction weights.
    "ppo": {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip_c": 1.3,
        "kl_coef": 0.5,
        "kl_estimator": "k3",
        "entropy_coef": 0.5,
        "proximal_logprobs": True,
        "rollout_weights": True,
    },
    "gspo": {
        "clip_low": 0.02,
        "clip_high": 0.03,
        "kl_coef": 0.5,
        "kl_estimator": "k3",
        "entropy_coef": 0.5,
        "proximal_logprobs": True,
        "rollout_weights": True,
    },
    "cispo": {"clip_low": 0.3, "clip_high": 0.2, "kl_coef": 0.5, "kl_estimator": "low_var_kl", "entropy_coef": 0.5},
    "importance_sampling": {"kl_coef": 0.5, "kl_estimator": "k2", "entropy_coef": 0.5},
}
RL_BUDGETS = (0, 24)
# (dp_replicate, dp_shard, cp, tp) layouts that run every RL loss, mode and budget.
RL_LAYOUTS = (
    (1, 1, 1, 1),
    (1, 2, 1, 1),
    (1, 4, 1, 1),
    (1, 1, 1, 2),
    (1, 1, 2, 1),
    (1, 2, 1, 2),
    (1, 2, 2, 1),
    (1, 1, 2, 2),
)


def rl_batch() -> list[Sample]:
    gen = torch.Generator().manual_seed(4)
    samples = []
    for i, sample in enumerate(global_batch("uneven")):
        n = len(sample)
        advantages = torch.randn(n, generator=gen)
        if i == RL_ZERO_ADVANTAGE:
            advantages.zero_()
        base = -torch.log(torch.tensor(float(VOCAB)))
        sample.advantages = advantages
        sample.sampler_logprobs = base + 0.3 * torch.randn(n, generator=gen)
        sample.ref_logprobs = base + 0.3 * torch.randn(n, generator=gen)
        sample.prox_logprobs = base + 0.3 * torch.randn(n, generator=gen)
        # Rollout-correction weights in [0, 2), a quarter of the tokens masked (0).
        weights = 2 * torch.rand(n, generator=gen)
        sample.rollout_weights = torch.where(torch.rand(n, generator=gen) < 0.25, 0.0, weights)
        sample.group_id = RL_GROUPS[i]
        samples.append(sample)
    return samples


def layouts(world_size: int) -> list[tuple[int, int, int, int]]:
    """(dp_replicate, dp_shard, cp, tp) layouts to check on this many ranks."""
    return {
        1: [(1, 1, 1, 1)],
        2: [(1, 2, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1)],
        4: [
            (1, 4, 1, 1),
            (2, 2, 1, 1),
            (4, 1, 1, 1),
            (1, 2, 1, 2),
            (1, 1, 1, 4),
            (1, 1, 4, 1),
            (1, 2, 2, 1),
            (1, 1, 2, 2),
            (2, 1, 2, 1),
        ],
        8: [(2, 2, 1, 2), (1, 2, 2, 2)],
    }[world_size]


# CP attention check: documents of these lengths packed together, several heads (GQA 2:1),
# with every CPU backend.
CP_ATTENTION_BACKENDS = ("sdpa_dense", "sdpa_varlen", "sdpa_loop")
CP_ATTENTION_LENS, CP_ATTENTION_HEADS, CP_ATTENTION_KV_HEADS, CP_ATTENTION_HEAD_DIM = (7, 1, 12, 4), 4, 2, 8


def cp_attention_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, output weights) over the packed documents, shared by every rank and the reference."""
    gen = torch.Generator().manual_seed(5)
    num_tokens = sum(CP_ATTENTION_LENS)
    q = torch.randn(num_tokens, CP_ATTENTION_HEADS, CP_ATTENTION_HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, CP_ATTENTION_KV_HEADS, CP_ATTENTION_HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, CP_ATTENTION_KV_HEADS, CP_ATTENTION_HEAD_DIM, generator=gen)
    out_weights = torch.randn(num_tokens, CP_ATTENTION_HEADS, CP_ATTENTION_HEAD_DIM, generator=gen)
    return q, k, v, out_weights


# Vocab-parallel log-prob check: tokens (divisible by every tp), model dim, chunk sizes
# (5 and 7 do not divide the token count).
LOGPROB_TOKENS, LOGPROB_DIM, LOGPROB_CHUNKS = 12, 16, (5, 7, 12)


def logprob_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [T, D], output weight [V, D], labels [T]) shared by every rank and the reference."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(LOGPROB_TOKENS, LOGPROB_DIM, generator=gen)
    weight = torch.randn(VOCAB, LOGPROB_DIM, generator=gen)
    labels = torch.randint(0, VOCAB, (LOGPROB_TOKENS,), generator=gen)
    return hidden, weight, labels


@contextlib.contextmanager
def one_thread():
    """Run the block with one intra-op thread, as every launched rank does (``reference.launch_env``):
    a reduction split over two threads rounds differently, so a bitwise comparison with a
    rank's result needs the same kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
