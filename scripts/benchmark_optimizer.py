"""AdamW implementations on CPU, measured: step time and agreement of fused with foreach.

    .venv/bin/python scripts/benchmark_optimizer.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_optimizer.py --no-write # print only

One process: the parameters of a Qwen3 of ``--dim`` width, ``--layers`` layers and ``--vocab``
embeddings (0.6B's width by default), one copy per implementation, each given the same
random gradients every step. ``optimizer.implementation`` ``foreach`` and ``fused``
(``build_optimizer``) take ``--steps`` steps, alternating between them; times are medians
after a warm-up step. The last column is the largest difference between the two copies'
parameters after all steps, relative to the largest parameter.
"""

import argparse
import dataclasses
import statistics
import time

import torch

from bench_common import add_publish_args, alternating_order, markdown_table, publish, ratio
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.optim import build_optimizer

IMPLEMENTATIONS = ("foreach", "fused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=10)
    add_publish_args(parser, "optimizer")
    args = parser.parse_args()
    model_args = dataclasses.replace(
        qwen3_flavors["0.6B"],
        dim=args.dim,
        n_layers=args.layers,
        hidden_dim=3 * args.dim,
        vocab_size=args.vocab,
    )
    models = {}
    for name in IMPLEMENTATIONS:
        models[name] = Qwen3Model(model_args)
        models[name].init_weights(0)
    optimizers = {name: build_optimizer(m, 1e-3, 0.9, 0.95, 1e-8, 0.1, name) for name, m in models.items()}
    num_params = sum(p.numel() for p in models["foreach"].parameters())
    times = {name: [] for name in IMPLEMENTATIONS}
    # Each step gives both copies the same new gradients, so not bench_common.time_alternating.
    for step, order in enumerate(alternating_order(list(IMPLEMENTATIONS), args.steps + 1)):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen) for p in models["foreach"].parameters()]
        for name in order:
            for p, g in zip(models[name].parameters(), grads):
                p.grad = g.clone()
            start = time.perf_counter()
            optimizers[name].step()
            if step > 0:  # the first step allocates the optimizer state
                times[name].append(time.perf_counter() - start)
    with torch.no_grad():
        scale = max(p.abs().max() for p in models["foreach"].parameters())
        diff = max((a - b).abs().max() for a, b in zip(models["fused"].parameters(), models["foreach"].parameters()))
    median = {name: statistics.median(values) for name, values in times.items()}
    rows = [
        [
            name,
            f"{median[name] * 1000:.0f} ms ({ratio(median[name], median['foreach'])})",
            "reference" if name == "foreach" else f"max difference {float(diff / scale):.1e} of the largest parameter",
        ]
        for name in IMPLEMENTATIONS
    ]
    body = [
        (
            f"One process, the {num_params / 1e6:.0f}M float32 parameters of a Qwen3 with dim {args.dim}, {args.layers} "
            f"layers, vocab {args.vocab}; {args.steps} steps on the same random gradients, alternating:"
        ),
        "",
        *markdown_table(["optimizer.implementation", "step time", "parameters after the steps vs foreach"], rows),
    ]
    publish(
        args,
        "Fused vs foreach AdamW",
        "Step time of AdamW's fused and foreach implementations, and how far their parameters drift apart.",
        body,
    )


if __name__ == "__main__":
    main()
