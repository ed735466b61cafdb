"""Rollout generation throughput: the static KV cache against rerunning the whole sequence.

    .venv/bin/python scripts/benchmark_generator.py            # rewrites its page in docs/benchmarks/
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

import torch

from bench_common import add_publish_args, markdown_table, publish, ratio, time_alternating
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--attn-backend", default="sdpa_loop", help="prefill / no-cache attention backend")
    parser.add_argument("--rounds", type=int, default=5)
    add_publish_args(parser, "generator")
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
    tokens = {name: [r.completion_tokens for r in rollouts] for name, rollouts in outputs.items()}
    same_tokens = tokens["kv_cache"] == tokens["no_cache"]
    generated = sum(len(r.completion_tokens) for r in outputs["kv_cache"])
    median = time_alternating({name: (lambda name=name: run(name)) for name in generators}, args.rounds, warmup=0)
    body = [
        (
            f"One process, `debugmodel` Qwen3 (fp32, `{args.attn_backend}` for prefill / no-cache), {len(prompts)} "
            f"prompts of {', '.join(map(str, args.prompt_lens))} tokens × {args.samples} samples, {args.new_tokens} new "
            f"tokens per row ({generated} in all), temperature 1, one batch; median of {args.rounds} alternating rounds "
            f"of `TorchGenerator.generate`. Both modes sampled the same tokens: {'yes' if same_tokens else 'NO'}."
        ),
        "",
        *markdown_table(
            ["mode", "time per generate", "generated tokens/s"],
            [[f"`{name}`", f"{median[name] * 1e3:.0f} ms", f"{generated / median[name]:.0f}"] for name in generators],
        ),
        "",
        f"- `kv_cache` / `no_cache` throughput: {ratio(median['no_cache'], median['kv_cache'], digits=1)}.",
    ]
    publish(
        args,
        "Rollout generator: KV cache vs no cache",
        "Generated tokens per second of `TorchGenerator` with "
        "its static KV cache against rerunning every row's whole sequence.",
        body,
    )


if __name__ == "__main__":
    main()
