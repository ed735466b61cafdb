"""Activation checkpointing on CPU, measured: peak step memory and step time at a long sequence.

    .venv/bin/python scripts/benchmark_activation_checkpoint.py             # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_activation_checkpoint.py --no-write  # print only

One process, a Qwen3 of ``--dim`` width and ``--layers`` layers (``debugmodel`` otherwise, vocab
512, ``sdpa_loop`` attention) training on one ``--tokens``-token sequence:
``Engine.forward_backward`` + ``optim_step`` with activation checkpointing ``none``, ``full``
and ``selective`` (every second block), alternating for ``--repeats`` rounds after a warm-up.
Peak memory is the largest amount of CPU memory the step allocated and had not yet freed, from
the PyTorch profiler (memory from before the step, parameters and optimizer state, is not
counted); times are medians of runs without the profiler.
"""

import argparse
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

from bench_common import add_publish_args, markdown_table, publish, ratio, time_alternating
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.profiling import cpu_memory_timeline
from torchtitan_rl.recipes.base import build_model

MODES = {"none": ("none", 1), "full": ("full", 1), "selective": ("selective", 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    add_publish_args(parser, "activation_checkpoint")
    args = parser.parse_args()
    torch.manual_seed(0)
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    device = torch.device("cpu")
    model_args = dataclasses.replace(
        qwen3_flavors["debugmodel"],
        dim=args.dim,
        n_layers=args.layers,
        hidden_dim=3 * args.dim,
        attn_backend="sdpa_loop",
        max_seq_len=args.tokens,
    )
    ids = torch.randint(0, model_args.vocab_size, (args.tokens + 1,))
    sample = Sample(input_ids=ids[:-1], labels=ids[1:], loss_mask=torch.ones(args.tokens, dtype=torch.bool))
    engines = {}
    for name, (mode, every) in MODES.items():
        model = build_model(
            model_args,
            parallel_dims=dims,
            device=device,
            seed=0,
            param_dtype=torch.float32,
            ac_mode=mode,
            ac_every=every,
        )
        optimizer = build_optimizer(model, 1e-5, 0.9, 0.95, 1e-8, 0.0)
        scheduler = build_lr_scheduler(optimizer, 10**6, 0, "linear", 0.0)
        options = EngineOptions(
            reduction="token_mean", horizon=1, max_tokens_per_microbatch=0, logits_chunk_size=1024, max_norm=1.0
        )
        engines[name] = Engine(
            model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
        )

    def step(engine: Engine) -> None:
        engine.forward_backward([sample])
        engine.optim_step()

    peaks = {}
    for name, engine in engines.items():
        step(engine)  # warm-up; allocates the optimizer state outside the measured step
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(engine)
        peaks[name] = cpu_memory_timeline(prof)["peak_allocated_bytes"] / 2**20
    median = time_alternating(
        {name: (lambda e=engine: step(e)) for name, engine in engines.items()}, args.repeats, warmup=0
    )
    body = [
        (
            f"One process, Qwen3 with dim {args.dim}, {args.layers} layers, vocab {model_args.vocab_size}, one sequence "
            f"of {args.tokens} tokens; peak memory allocated by the step (profiler), median step time of {args.repeats} "
            "alternating rounds:"
        ),
        "",
        *markdown_table(
            ["activation_checkpoint.mode", "peak step memory", "step time"],
            [
                [
                    name,
                    f"{peaks[name]:.0f} MiB ({ratio(peaks[name], peaks['none'])})",
                    f"{median[name] * 1000:.0f} ms ({ratio(median[name], median['none'])})",
                ]
                for name in engines
            ],
        ),
    ]
    publish(
        args,
        "Activation checkpointing",
        "Peak step memory and step time of activation checkpointing `none`, "
        "`full` and `selective` on one long sequence (CPU).",
        body,
    )


if __name__ == "__main__":
    main()
