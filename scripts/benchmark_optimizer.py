"""AdamW implementations on CPU, measured: step time and agreement of fused with foreach.

    .venv/bin/python scripts/benchmark_optimizer.py            # appends to docs/benchmarks.md
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
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark_docs import publish  # noqa: E402
from torchtitan_rl.models.qwen3.args import qwen3_flavors  # noqa: E402
from torchtitan_rl.models.qwen3.model import Qwen3Model  # noqa: E402
from torchtitan_rl.optim import build_optimizer  # noqa: E402

IMPLEMENTATIONS = ("foreach", "fused")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    model_args = dataclasses.replace(
        qwen3_flavors["0.6B"], dim=args.dim, n_layers=args.layers, hidden_dim=3 * args.dim, vocab_size=args.vocab,
    )
    models = {}
    for name in IMPLEMENTATIONS:
        models[name] = Qwen3Model(model_args)
        models[name].init_weights(0)
    optimizers = {name: build_optimizer(m, 1e-3, 0.9, 0.95, 1e-8, 0.1, name) for name, m in models.items()}
    num_params = sum(p.numel() for p in models["foreach"].parameters())
    times = {name: [] for name in IMPLEMENTATIONS}
    for step in range(args.steps + 1):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen) for p in models["foreach"].parameters()]
        for name in IMPLEMENTATIONS if step % 2 == 0 else reversed(IMPLEMENTATIONS):
            for p, g in zip(models[name].parameters(), grads):
                p.grad = g.clone()
            start = time.perf_counter()
            optimizers[name].step()
            if step > 0:  # the first step allocates the optimizer state
                times[name].append(time.perf_counter() - start)
    scale = max(p.abs().max() for p in models["foreach"].parameters())
    diff = max((a - b).abs().max() for a, b in zip(models["fused"].parameters(), models["foreach"].parameters()))
    median = {name: statistics.median(values) for name, values in times.items()}
    shown = "python scripts/benchmark_optimizer.py" + ("" if sys.argv[1:] == [] else " " + " ".join(sys.argv[1:]))
    lines = [
        f"## Fused vs foreach AdamW on CPU ({datetime.date.today()})",
        "",
        f"Command: `{shown}` — machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        "shared with other jobs (times are medians of alternating steps).",
        "",
        f"One process, the {num_params / 1e6:.0f}M float32 parameters of a Qwen3 with dim {args.dim}, {args.layers} "
        f"layers, vocab {args.vocab}; {args.steps} steps on the same random gradients:",
        "",
        "| optimizer.implementation | step time | parameters after the steps vs foreach |",
        "|---|---|---|",
        *(f"| {name} | {median[name] * 1000:.0f} ms ({median[name] / median['foreach']:.2f}x) | "
          + ("reference" if name == "foreach" else f"max difference {float(diff / scale):.1e} of the largest parameter")
          + " |" for name in IMPLEMENTATIONS),
    ]
    publish(lines, write=not args.no_write)


if __name__ == "__main__":
    main()
