"""Activation checkpointing (distributed/activation_checkpoint.py), single process on CPU.

Equal gradients alone would also hold if checkpointing did nothing, so each test also counts
how often every block runs: a checkpointed block runs its forward a second time in backward
(the recomputation), a plain one once, per micro-batch. The count is taken by a pre-hook on
the block's first submodule, which the recomputation calls again (a hook on the block itself
would not fire: the recomputation calls the block's original ``forward``, not the module).
"""

import pytest
import torch

from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.activation_checkpoint import (
    apply_activation_checkpointing,
)
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.recipes.base import build_model

CPU = torch.device("cpu")
ARGS = Qwen3ModelArgs(
    vocab_size=64,
    dim=32,
    n_layers=5,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=48,
    max_seq_len=64,
    attn_backend="sdpa_dense",
)
# A budget of 16 tokens packs these samples into three micro-batches.
BUDGET = 16
LENGTHS = (5, 9, 7, 11, 4)


def single_rank() -> ParallelDims:
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    return dims


def build(ac_mode: str, ac_every: int = 1):
    return build_model(
        ARGS,
        parallel_dims=single_rank(),
        device=CPU,
        seed=0,
        param_dtype=torch.float32,
        ac_mode=ac_mode,
        ac_every=ac_every,
    )


def samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, ARGS.vocab_size, (n,), generator=gen)
        labels = torch.randint(0, ARGS.vocab_size, (n,), generator=gen)
        out.append(Sample(input_ids=ids, labels=labels, loss_mask=torch.arange(n) >= n // 3))
    return out


def count_forwards(model) -> tuple[list[int], list[int]]:
    """([runs of each block], [runs of the whole model]), updated as the model runs.

    The final norm runs once per model forward and is never recomputed: it counts micro-batches.
    """
    block_runs, model_runs = [0] * len(model.blocks()), [0]
    for i, block in enumerate(model.blocks()):

        def count(module, args, i=i):
            block_runs[i] += 1

        block.attention_norm.register_forward_pre_hook(count)
    model.norm.register_forward_pre_hook(lambda module, args: model_runs.__setitem__(0, model_runs[0] + 1))
    return block_runs, model_runs


def step(ac_mode: str, ac_every: int = 1) -> tuple[dict[str, torch.Tensor], list[int], int]:
    """(gradients, runs of each block, micro-batches) of one forward_backward."""
    model = build(ac_mode, ac_every)
    block_runs, model_runs = count_forwards(model)
    options = EngineOptions(
        reduction="token_mean", horizon=32, max_tokens_per_microbatch=BUDGET, logits_chunk_size=8, max_norm=0.0
    )
    engine = Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=single_rank(), device=CPU, options=options)
    engine.forward_backward(samples())
    return {fqn: p.grad.clone() for fqn, p in model.named_parameters()}, block_runs, model_runs[0]


@pytest.mark.parametrize(
    "ac_mode, every, recomputed",
    [
        ("none", 1, set()),
        ("full", 1, {0, 1, 2, 3, 4}),
        ("selective", 2, {0, 2, 4}),
        ("selective", 3, {0, 3}),
    ],
)
def test_checkpointed_blocks_are_recomputed_and_gradients_unchanged(ac_mode, every, recomputed):
    plain, plain_runs, micro_batches = step("none")
    assert micro_batches == 3, "the samples must span several micro-batches"
    assert plain_runs == [micro_batches] * ARGS.n_layers
    grads, runs, _ = step(ac_mode, every)
    assert runs == [micro_batches * (2 if i in recomputed else 1) for i in range(ARGS.n_layers)]
    assert grads.keys() == plain.keys()  # parameter names unchanged
    for fqn, g in plain.items():
        torch.testing.assert_close(grads[fqn], g, rtol=1e-6, atol=1e-9, msg=fqn)


def test_checkpointing_saves_fewer_activations():
    """Tensors autograd keeps for backward during the forward: full checkpointing keeps far
    fewer than none (the blocks' inputs instead of every intermediate)."""

    def saved_bytes(ac_mode: str) -> int:
        model = build(ac_mode)
        batch = samples()[1]
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            n = len(batch)
            model(batch.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long))
        return total[0]

    assert saved_bytes("full") < 0.5 * saved_bytes("none")


def test_unknown_mode_names_the_key():
    with pytest.raises(ValueError, match="activation_checkpoint.mode: 'op'"):
        apply_activation_checkpointing([], "op")
