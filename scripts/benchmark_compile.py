"""Per-block torch.compile (inductor) on CPU, measured: compile cost, step time, recompiles.

    .venv/bin/python scripts/benchmark_compile.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_compile.py --no-write # print only

One process, float32. For each model: ``Engine.forward_backward`` + ``optim_step`` on
mini-batches of documents of random lengths packed into micro-batches of at most ``budget``
tokens (so every micro-batch has its own length), eager and with ``compile.enable``
(``build_model(compile_backend=...)``), alternating for ``--repeats`` steps after the first
(which compiles, timed alone). Reports the first step's time, the median of the others, and how many
graphs inductor compiled in all steps (counted around the backend).
"""

import argparse
import dataclasses
import time

import torch
from torch._dynamo.testing import CompileCounterWithBackend

from bench_common import add_publish_args, markdown_table, publish, ratio, time_alternating
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model


def minibatch(vocab: int, num_docs: int, max_len: int, seed: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in torch.randint(max_len // 4, max_len + 1, (num_docs,), generator=gen).tolist():
        ids = torch.randint(0, vocab, (n + 1,), generator=gen)
        samples.append(Sample(input_ids=ids[:-1], labels=ids[1:], loss_mask=torch.ones(n, dtype=torch.bool)))
    return samples


def measure(name: str, model_args, num_docs: int, max_len: int, budget: int, repeats: int) -> dict:
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    device = torch.device("cpu")
    counter = CompileCounterWithBackend("inductor")
    engines = {}
    for variant, backend in (("eager", None), ("compiled", counter)):
        model = build_model(
            model_args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32, compile_backend=backend
        )
        optimizer = build_optimizer(model, 1e-5, 0.9, 0.95, 1e-8, 0.0)
        scheduler = build_lr_scheduler(optimizer, 10**6, 0, "linear", 0.0)
        options = EngineOptions(
            reduction="token_mean", horizon=1, max_tokens_per_microbatch=budget, logits_chunk_size=1024, max_norm=1.0
        )
        engines[variant] = Engine(
            model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
        )
    # Every variant takes the same sequence of mini-batches, one new batch per step.
    batches = [minibatch(model_args.vocab_size, num_docs, max_len, seed=step) for step in range(repeats + 1)]

    def stepper(engine: Engine):
        pending = iter(batches)

        def step():
            engine.forward_backward(next(pending))
            engine.optim_step()

        return step

    steps = {variant: stepper(engine) for variant, engine in engines.items()}
    first = {}
    for variant, step in steps.items():  # the compiling step, timed on its own
        start = time.perf_counter()
        step()
        first[variant] = time.perf_counter() - start
    median = time_alternating(steps, repeats, warmup=0)
    return {"name": name, "first": first, "median": median, "graphs": counter.frame_count, "steps": repeats + 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6)
    add_publish_args(parser, "compile")
    args = parser.parse_args()
    debug = dataclasses.replace(qwen3_flavors["debugmodel"], attn_backend="sdpa_loop")
    wide = dataclasses.replace(qwen3_flavors["0.6B"], n_layers=2, vocab_size=4096, attn_backend="sdpa_loop")
    cases = [
        ("debugmodel; 32 documents of 32-128 tokens, micro-batches of <= 512", debug, 32, 128, 512),
        (
            "2 layers of 0.6B's width, vocab 4096; 8 documents of 128-512 tokens, micro-batches of <= 1024",
            wide,
            8,
            512,
            1024,
        ),
    ]
    results = [
        measure(name, model_args, docs, max_len, budget, args.repeats)
        for name, model_args, docs, max_len, budget in cases
    ]
    body = [
        (
            "One process, float32, `Engine.forward_backward` + `optim_step`; every step is a new mini-batch, so "
            "micro-batch lengths differ throughout. First step: eager vs compiling; graphs: how many inductor compiled "
            "over all steps (no recompile per micro-batch length):"
        ),
        "",
        *markdown_table(
            [
                "model and data",
                "first step: eager / compiled",
                "step time: eager",
                "step time: compiled",
                "graphs compiled (steps)",
            ],
            [
                [
                    r["name"],
                    f"{r['first']['eager']:.1f} s / {r['first']['compiled']:.1f} s",
                    f"{r['median']['eager'] * 1e3:.0f} ms",
                    f"{r['median']['compiled'] * 1e3:.0f} ms ({ratio(r['median']['eager'], r['median']['compiled'])} speed)",
                    f"{r['graphs']} ({r['steps']})",
                ]
                for r in results
            ],
        ),
    ]
    publish(
        args,
        "Per-block torch.compile",
        "Compile cost, step time and recompiles of per-block `torch.compile` "
        "(inductor) against eager, on micro-batches of ever-new lengths.",
        body,
    )


if __name__ == "__main__":
    main()
