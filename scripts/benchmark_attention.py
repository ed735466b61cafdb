"""Attention backends on CPU: the default (``auto`` → ``sdpa_varlen``) against ``sdpa_loop`` and
``sdpa_dense``, every variant measured in the same run, alternating.

    .venv/bin/python scripts/benchmark_attention.py            # rewrites docs/benchmarks/attention.md
    .venv/bin/python scripts/benchmark_attention.py --no-write # print only

1. The debug recipe end to end: ``train.py --job.config_file train_configs/debug_model.toml`` on
   2 gloo ranks for ``--steps`` steps per backend, ``--rounds`` rounds; the median of the logged
   tokens/s windows after the first, and the wall-clock including start-up.
2. Forward + backward of the ``debugmodel`` (and of packed attention alone) on one micro-batch:
   the recipe's first micro-batch (document lengths recorded from it), 4 × 256 and 8 × 512
   documents, and a context-parallel share (rank 0 of cp = 2, zigzag, of 8 × 512: its queries
   against the keys of both ranks). Medians of ``--repeats`` alternating rounds.
"""

import argparse
import dataclasses
import statistics

import torch
import torch.nn.functional as F

from bench_common import (
    add_publish_args,
    collect_alternating,
    markdown_table,
    publish,
    ratio,
    run_train,
    time_alternating,
)
from torchtitan_rl.distributed.context_parallel import ZigzagLayout
from torchtitan_rl.models.attention import build_attention_context, packed_attention
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.models.qwen3.model import Qwen3Model

BACKENDS = ("auto", "sdpa_loop", "sdpa_dense")
# Document lengths of the debug recipe's first micro-batch (arithmetic problems packed up to
# 512 tokens), recorded from its build_attention_context call.
RECIPE_MICROBATCH = [35, 39, 35, 38, 36, 35, 38, 37, 36, 36, 39, 37, 36, 35]


def recipe_run(backend: str, steps: int) -> dict[str, float]:
    run = run_train(
        [
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--training.steps",
            str(steps),
            "--model.attn_backend",
            backend,
        ],
        ranks=2,
    )
    tps = run.series("throughput(tps)")
    return {"wall": run.wall_s, "tps": statistics.median([tps[step] for step in sorted(tps)][1:])}  # 1st: warm-up


def bench_recipe(steps: int, rounds: int) -> dict[str, dict[str, float]]:
    runs = collect_alternating({b: (lambda b=b: recipe_run(b, steps)) for b in BACKENDS}, rounds)
    return {b: {k: statistics.median(r[k] for r in rs) for k in ("wall", "tps")} for b, rs in runs.items()}


def packed(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return seq_ids, torch.cat([torch.arange(n) for n in lengths])


def bench_model(lengths: list[int], repeats: int) -> dict[str, float]:
    """Forward + backward of the debugmodel on one packed micro-batch, seconds per backend."""
    torch.manual_seed(0)
    args = qwen3_flavors["debugmodel"]
    model = Qwen3Model(args)
    model.init_weights(0)
    seq_ids, positions = packed(lengths)
    tokens = torch.randint(0, args.vocab_size, (seq_ids.numel(),))

    def step(backend):
        def run():
            model.args = dataclasses.replace(args, attn_backend=backend)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model.output(model(tokens, positions, seq_ids)), tokens).backward()

        return run

    return time_alternating({b: step(b) for b in BACKENDS}, repeats)


def bench_kernel(q_ids, q_pos, kv_ids, kv_pos, repeats: int) -> dict[str, float]:
    """Packed attention alone (context build + forward + backward, the debugmodel's 4 query /
    2 KV heads of 32 dims), seconds per backend."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(q_ids.numel(), 4, 32, generator=gen, requires_grad=True)
    k, v = (torch.randn(kv_ids.numel(), 2, 32, generator=gen, requires_grad=True) for _ in range(2))

    def step(backend):
        def run():
            context = build_attention_context(backend, q_ids, q_pos, kv_ids, kv_pos)
            packed_attention(q, k, v, context).sum().backward()

        return run

    return time_alternating({b: step(b) for b in BACKENDS}, repeats)


def cp_share(lengths: list[int], cp: int, rank: int):
    layout = ZigzagLayout.build(lengths, cp)
    kv_ids = torch.cat([layout.seq_ids(r) for r in range(cp)])
    kv_pos = torch.cat([layout.positions(r) for r in range(cp)])
    return layout.seq_ids(rank), layout.positions(rank), kv_ids, kv_pos


def speedups(times: dict[str, float]) -> list[str]:
    """Table cells: how many times faster ``auto`` is than sdpa_loop, than sdpa_dense."""
    return [ratio(times["sdpa_loop"], times["auto"]), ratio(times["sdpa_dense"], times["auto"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps per debug-recipe run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of debug-recipe runs")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds of each micro-batch measurement")
    add_publish_args(parser, "attention")
    args = parser.parse_args()
    torch.set_num_threads(1)

    recipe = bench_recipe(args.steps, args.rounds)
    packings = {
        f"debug recipe micro-batch ({len(RECIPE_MICROBATCH)} docs of 35-39)": RECIPE_MICROBATCH,
        "4 × 256": [256] * 4,
        "8 × 512": [512] * 8,
    }
    rows = []
    for name, lengths in packings.items():
        model = bench_model(lengths, args.repeats)
        kernel = bench_kernel(*packed(lengths), *packed(lengths), args.repeats)
        rows.append((name, sum(lengths), model, kernel))
    cp_kernel = bench_kernel(*cp_share([512] * 8, cp=2, rank=0), args.repeats)

    body = [
        "float32, one thread per process. `auto vs X` = time of X / time of auto (> 1: auto is faster).",
        "",
        (
            f"Debug recipe (`train.py --job.config_file train_configs/debug_model.toml`, 2 gloo ranks, {args.steps} "
            f"steps, median of {args.rounds} runs per backend; tokens/s = median logged window after the first):"
        ),
        "",
        *markdown_table(
            ["backend", "tokens/s per rank", "wall-clock incl. start-up"],
            [
                [b, f"{r['tps']:.0f} ({ratio(r['tps'], recipe['auto']['tps'])} of auto)", f"{r['wall']:.1f} s"]
                for b, r in recipe.items()
            ],
        ),
        "",
        (
            "One packed micro-batch, `debugmodel` forward + backward (tokens/s) and packed attention alone "
            f"(context build + forward + backward), median of {args.repeats} alternating rounds:"
        ),
        "",
        *markdown_table(
            [
                "packing",
                "tokens",
                "model: auto tokens/s",
                "model: auto vs loop",
                "model: auto vs dense",
                "attention: auto ms",
                "attention: auto vs loop",
                "attention: auto vs dense",
            ],
            [
                [
                    name,
                    tokens,
                    f"{tokens / model['auto']:.0f}",
                    *speedups(model),
                    f"{kernel['auto'] * 1e3:.1f}",
                    *speedups(kernel),
                ]
                for name, tokens, model, kernel in rows
            ]
            + [
                [
                    "CP share: rank 0 of cp=2, 8 × 512 (2048 queries × 4096 keys)",
                    2048,
                    "",
                    "",
                    "",
                    f"{cp_kernel['auto'] * 1e3:.1f}",
                    *speedups(cp_kernel),
                ]
            ],
        ),
    ]
    publish(
        args,
        "Attention backends",
        "`auto` (= `sdpa_varlen` on CPU) against `sdpa_loop` and `sdpa_dense`: the "
        "debug recipe end to end, one packed micro-batch, and a context-parallel share.",
        body,
    )


if __name__ == "__main__":
    main()
