"""Rollout generation throughput: the static KV cache against rerunning the whole sequence.

    .venv/bin/python scripts/benchmark_generator.py            # appends to docs/benchmarks.md
    .venv/bin/python scripts/benchmark_generator.py --no-write # print only

One process, the ``debugmodel`` Qwen3 (initialized weights), ``--prompt-lens`` prompts with
``--samples`` samples each, ``--new-tokens`` completion tokens per row (no stop tokens, so every
row generates them all), temperature 1. Each round times one ``TorchGenerator.generate`` with
``kv_cache=True`` and one with ``kv_cache=False`` (the no-cache reference: the full packed model
over every row's sequence at every step), alternating the order; generated tokens per second
are compared as medians and as a ratio measured in the same run. Both modes must sample the
same tokens (same weights and seeds), which the script checks.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmark_docs import publish  # noqa: E402
from torchtitan_rl.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan_rl.models.qwen3.args import qwen3_flavors  # noqa: E402
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator  # noqa: E402
from torchtitan_rl.recipes.base import build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--attn-backend", default="sdpa_loop", help="prefill / no-cache attention backend")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes(device.type)
    model_args = dataclasses.replace(qwen3_flavors["debugmodel"], attn_backend=args.attn_backend)
    model = build_model(model_args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model_args.vocab_size, (n,), generator=gen).tolist() for n in args.prompt_lens]
    indices = list(range(len(prompts)))
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    generators = {}
    for name, kv_cache in (("kv_cache", True), ("no_cache", False)):
        generators[name] = TorchGenerator(model_args, device, max_prompts_per_batch=len(prompts), kv_cache=kv_cache)
        generators[name].update_weights(model)

    def run(name):
        return generators[name].generate(prompts, indices, args.samples, params, seed=0, step=0)

    outputs = {name: run(name) for name in generators}  # warm-up, and the same-tokens check
    same_tokens = [r.completion_tokens for r in outputs["kv_cache"]] == [r.completion_tokens for r in outputs["no_cache"]]
    generated = sum(len(r.completion_tokens) for r in outputs["kv_cache"])
    times = {name: [] for name in generators}
    for r in range(args.rounds):
        for name in (list(generators) if r % 2 == 0 else list(reversed(generators))):
            start = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}

    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.machine()}, {os.cpu_count()} cores, CPU only")
    cmd = " ".join([".venv/bin/python", "scripts/benchmark_generator.py", *sys.argv[1:]])
    lines = [
        f"## Rollout generator: KV cache vs no cache, {datetime.date.today().isoformat()} ({machine}, torch {torch.__version__})",
        "",
        f"Command: `{cmd}` — one process, `debugmodel` Qwen3 (fp32, `{args.attn_backend}` for prefill / no-cache), "
        f"{len(prompts)} prompts of {', '.join(map(str, args.prompt_lens))} tokens × {args.samples} samples, "
        f"{args.new_tokens} new tokens per row ({generated} in all), temperature 1, one batch; median of "
        f"{args.rounds} alternating rounds of `TorchGenerator.generate`. Both modes sampled the same tokens: "
        f"{'yes' if same_tokens else 'NO'}.",
        "",
        "| mode | time per generate | generated tokens/s |",
        "|---|---|---|",
        *[f"| `{name}` | {median[name] * 1e3:.0f} ms | {generated / median[name]:.0f} |" for name in generators],
        "",
        f"- `kv_cache` / `no_cache` throughput: {median['no_cache'] / median['kv_cache']:.1f}×.",
        "",
    ]
    publish(lines, write=not args.no_write)


if __name__ == "__main__":
    main()
