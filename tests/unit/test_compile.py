"""Per-block torch.compile (distributed/compile.py), single process on CPU.

The reference is the same model built without compile, run eagerly on the same samples.
Compiles are counted by a counting wrapper around the backend: packed micro-batches of new
lengths must not compile each graph more than twice. Models are one or two layers deep
because an inductor compile on a 2-core CI machine takes seconds per graph.
"""

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from test_generator import CB_PARAMS, MANY_PROMPTS, noisy_model
from torchtitan_rl.config.manager import ConfigManager
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.router import RouterLossConfig
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import TorchGenerator

CPU = torch.device("cpu")
ARGS = Qwen3ModelArgs(
    vocab_size=64,
    dim=32,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    hidden_dim=48,
    rope_theta=10_000.0,
    max_seq_len=64,
    attn_backend="sdpa_dense",
)
# A dense layer then an MoE layer of 4 experts, top-2.
MOE_ARGS = dataclasses.replace(
    ARGS,
    n_layers=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_hidden_dim=16,
    norm_topk_prob=True,
    mlp_only_layers=(0,),
)
RTOL = 1e-5
# A budget of 16 tokens packs these samples into four micro-batches of four different lengths.
BUDGET = 16
LENGTHS = (5, 7, 9, 7, 11, 4, 6)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compile counts start from an empty cache (other tests compile the same block code)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def samples(lengths, seed: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, ARGS.vocab_size, (n,), generator=gen)
        labels = torch.randint(0, ARGS.vocab_size, (n,), generator=gen)
        out.append(Sample(input_ids=ids, labels=labels, loss_mask=torch.arange(n) >= n // 3))
    return out


def single_rank() -> ParallelDims:
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    return dims


def gradients(model, batch, budget: int) -> dict[str, torch.Tensor]:
    # MoE: router losses on, so the router statistics' gradients pass the compiled graphs too
    # (per-sequence balance: the global one adds a no-grad counting pass, compiled separately).
    router = RouterLossConfig(0.01, "sequence", "pooled", 0.001) if model.args.is_moe else None
    options = EngineOptions(
        reduction="token_mean",
        horizon=32,
        max_tokens_per_microbatch=budget,
        logits_chunk_size=8,
        max_norm=0.0,
        router=router,
    )
    engine = Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=single_rank(), device=CPU, options=options)
    model.zero_grad(set_to_none=True)
    engine.forward_backward(batch)
    return {fqn: p.grad.clone() for fqn, p in model.named_parameters()}


def build(args, backend=None, ac_mode: str = "none"):
    return build_model(
        args,
        parallel_dims=single_rank(),
        device=CPU,
        seed=0,
        param_dtype=torch.float32,
        ac_mode=ac_mode,
        compile_backend=backend,
    )


def assert_rel_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for fqn, g in expected.items():
        err = float((actual[fqn] - g).norm() / g.norm())
        assert err <= RTOL, f"{what} {fqn}: relative error {err:.2e}"


def test_compiled_blocks_match_eager_and_compile_at_most_twice():
    """Inductor-compiled blocks give eager's gradients (1e-5) over micro-batches of four
    lengths; each graph compiles at most twice (a first length, then dynamic in the token
    count), no more for further lengths, and the compiled code serves an
    activation-checkpointed model without compiling again."""
    eager = build(ARGS)
    counter = CompileCounterWithBackend("inductor")
    compiled = build(ARGS, counter)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # names (seeds, checkpoints) kept
    for p, q in zip(compiled.parameters(), eager.parameters()):
        assert torch.equal(p, q)  # same init

    gradients(compiled, samples((3, 8), seed=1), budget=0)
    first_compiles = counter.frame_count
    assert first_compiles > 0
    batch = samples(LENGTHS, seed=2)
    expected = gradients(eager, batch, BUDGET)
    assert_rel_close(gradients(compiled, batch, BUDGET), expected, "compiled")
    all_compiles = counter.frame_count
    assert all_compiles <= 2 * first_compiles
    gradients(compiled, samples((10, 3, 7, 13, 14), seed=3), BUDGET)  # micro-batches of 13, 7, 13, 14
    assert counter.frame_count == all_compiles, "a new micro-batch length recompiled"

    checkpointed = build(ARGS, counter, ac_mode="full")
    assert_rel_close(gradients(checkpointed, batch, BUDGET), expected, "compiled + activation checkpointing")
    assert counter.frame_count == all_compiles


def test_compiled_moe_blocks_match_eager_with_bounded_compiles():
    """The same for a dense + MoE model, captured by dynamo but run without inductor (an
    inductor compile of both block kinds costs CI too long); the experts run eagerly. The
    MoE graphs compile a third time at most: the sequence count sizes the router statistics,
    and a micro-batch of a single sequence is a size dynamo specializes."""
    eager = build(MOE_ARGS)
    counter = CompileCounterWithBackend("eager")
    compiled = build(MOE_ARGS, counter)
    gradients(compiled, samples((3, 8), seed=1), budget=0)
    first_compiles = counter.frame_count
    batch = samples(LENGTHS, seed=2)
    assert_rel_close(gradients(compiled, batch, BUDGET), gradients(eager, batch, BUDGET), "compiled MoE")
    assert counter.frame_count <= 3 * first_compiles


def test_compile_settings():
    cfg = ConfigManager().parse_args(["--compile.enable", "true", "--compile.backend", "aot_eager"])
    assert (cfg.compile.enable, cfg.compile.backend) == (True, "aot_eager")
    for argv, fragment in (
        (["--compile.backend", "eager"], "compile.backend: only used with compile.enable = true"),
        (["--compile.enable", "true", "--compile.backend", "tvm"], "compile.backend"),
    ):
        with pytest.raises(ValueError, match=fragment):
            ConfigManager().parse_args(argv)


def assert_compiled_decoding_matches_eager(device: torch.device, atol: float) -> None:
    """The same rollouts from a compiled and an eager generator on ``device``, 7 prompts x 3
    samples through a cache of 12 rows (buckets 8 and 12, refills); a graph per bucket."""
    counters.clear()
    model = noisy_model(ARGS)
    rollouts = {}
    for compile in (False, True):
        gen = TorchGenerator(ARGS, device, max_prompts_per_batch=4, compile=compile)
        gen.update_weights(model)
        decoded_rows = []
        decode = gen.decode
        gen.decode = lambda tokens, positions, cache: (
            decoded_rows.append(len(tokens)) or decode(tokens, positions, cache)
        )
        rollouts[compile] = gen.generate(MANY_PROMPTS, list(range(7)), 3, CB_PARAMS, 3, 1)
    assert [r.completion_tokens for r in rollouts[True]] == [r.completion_tokens for r in rollouts[False]]
    for compiled, eager in zip(rollouts[True], rollouts[False]):
        torch.testing.assert_close(torch.tensor(compiled.logprobs), torch.tensor(eager.logprobs), rtol=0, atol=atol)
    # Premises: steps of both buckets ran (more than 8 rows, and fewer), and prompts refilled the cache.
    assert max(decoded_rows) > 8 and min(decoded_rows) < 8
    assert counters["stats"]["unique_graphs"] == 2


def test_compiled_decode_steps_match_eager_with_one_graph_per_bucket():
    """generation.compile on CPU (inductor): the decode step compiled per bucket of running rows
    samples the same rollouts as eager decoding while rows finish and queued prompts refill."""
    assert_compiled_decoding_matches_eager(CPU, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_decode_steps_with_cuda_graphs_match_eager():
    """The same on CUDA, where the compiled step replays CUDA graphs (mode="reduce-overhead")
    over a cache written in place; CUDA kernels of other shapes round a little more."""
    assert_compiled_decoding_matches_eager(torch.device("cuda"), atol=1e-4)


def test_compiled_decode_shapes_stay_in_few_buckets():
    """Over generations of many prompt lengths and lengths to generate, the compiled decode step
    sees only (row bucket, slot bucket) shapes: slots a power of two from 64 holding every row's
    reach, rows a power of two from 8 or the capacity, and fewer shapes than dynamo's recompile
    limit, which the generator raises (past it the rest would run eagerly). The shapes are
    recorded without compiling; the compiled step itself is checked above."""
    args = dataclasses.replace(ARGS, max_seq_len=256)
    gen = TorchGenerator(args, CPU, max_prompts_per_batch=4, compile=True)
    gen.update_weights(noisy_model(args))
    shapes, reaches = set(), set()
    forward = gen._forward

    def record(tokens, positions, seq_ids, attention, rows, images):
        slots = attention.cache.num_slots
        shapes.add((tokens.numel(), slots))
        reaches.add(int(positions.max()) + 1)
        assert int(positions.max()) < slots
        return forward(tokens, positions, seq_ids, attention, rows, images)

    gen._decode_forward = record
    for step, (prompt_len, max_new_tokens) in enumerate([(3, 10), (17, 25), (40, 9), (61, 70), (90, 30)]):
        prompts = [[(7 * i + p) % 58 + 6 for i in range(prompt_len + 3 * p)] for p in range(5)]
        params = dataclasses.replace(CB_PARAMS, max_new_tokens=max_new_tokens, stop_token_ids=())
        gen.generate(prompts, list(range(5)), 3, params, 0, step)
    slot_counts = {slots for _, slots in shapes}
    assert slot_counts <= {64, 128, 256}
    assert len(reaches) > 3 * len(slot_counts)  # premise: many more lengths than slot buckets
    assert {rows for rows, _ in shapes} <= {8, 12}  # buckets of a 12-row cache (4 prompts x 3)
    assert len(shapes) <= torch._dynamo.config.recompile_limit
    assert torch._dynamo.config.recompile_limit >= 121
