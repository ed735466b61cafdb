"""Attention backends on CPU: the default (``auto`` → ``sdpa_varlen``) against ``sdpa_loop`` and
``sdpa_dense``, every variant measured in the same run, alternating.

    .venv/bin/python scripts/benchmark_attention.py            # appends to docs/benchmarks.md
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
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmark_docs import publish  # noqa: E402
from torchtitan_rl.distributed.context_parallel import ZigzagLayout  # noqa: E402
from torchtitan_rl.models.attention import build_attention_context, packed_attention  # noqa: E402
from torchtitan_rl.models.qwen3.args import qwen3_flavors  # noqa: E402
from torchtitan_rl.models.qwen3.model import Qwen3Model  # noqa: E402

BACKENDS = ("auto", "sdpa_loop", "sdpa_dense")
# Document lengths of the debug recipe's first micro-batch (arithmetic problems packed up to
# 512 tokens), recorded from its build_attention_context call.
RECIPE_MICROBATCH = [35, 39, 35, 38, 36, 35, 38, 37, 36, 36, 39, 37, 36, 35]


def train_run(backend: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               "--job.config_file", "train_configs/debug_model.toml", "--training.steps", str(steps),
               "--model.attn_backend", backend, "--job.dump_folder", dump]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    tps = [float(line.split("tps: ")[1].split()[0]) for line in (proc.stdout + proc.stderr).splitlines()
           if " step: " in line and "tps: " in line]
    return {"wall": wall, "tps": statistics.median(tps[1:])}  # the first window holds the warm-up


def bench_recipe(steps: int, rounds: int) -> dict[str, dict[str, float]]:
    runs = {b: [] for b in BACKENDS}
    for round_ in range(rounds):
        for backend in BACKENDS if round_ % 2 == 0 else reversed(BACKENDS):
            runs[backend].append(train_run(backend, steps))
    return {b: {k: statistics.median(r[k] for r in rs) for k in ("wall", "tps")} for b, rs in runs.items()}


def packed(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return seq_ids, torch.cat([torch.arange(n) for n in lengths])


def alternate(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each step function, one warm-up round, order reversed every round."""
    times = {name: [] for name in steps}
    for round_ in range(repeats + 1):
        for name in steps if round_ % 2 == 0 else reversed(list(steps)):
            start = time.perf_counter()
            steps[name]()
            if round_ > 0:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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

    return alternate({b: step(b) for b in BACKENDS}, repeats)


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

    return alternate({b: step(b) for b in BACKENDS}, repeats)


def cp_share(lengths: list[int], cp: int, rank: int):
    layout = ZigzagLayout.build(lengths, cp)
    kv_ids = torch.cat([layout.seq_ids(r) for r in range(cp)])
    kv_pos = torch.cat([layout.positions(r) for r in range(cp)])
    return layout.seq_ids(rank), layout.positions(rank), kv_ids, kv_pos


def speedups(times: dict[str, float]) -> str:
    """Table cells: how many times faster ``auto`` is than sdpa_loop, than sdpa_dense."""
    return f"{times['sdpa_loop'] / times['auto']:.2f}x | {times['sdpa_dense'] / times['auto']:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps per debug-recipe run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of debug-recipe runs")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds of each micro-batch measurement")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to docs/benchmarks.md")
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

    shown = "python scripts/benchmark_attention.py" + ("" if sys.argv[1:] == [] else " " + " ".join(sys.argv[1:]))
    lines = [
        f"## Attention work ∝ Σ Lᵢ²: `auto` (= `sdpa_varlen` on CPU) vs `sdpa_loop` and `sdpa_dense` "
        f"({datetime.date.today()})",
        "",
        f"Command: `{shown}` — machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        "float32, OMP_NUM_THREADS=1; the machine is shared with other jobs, so every comparison alternates the "
        "backends within one run and reports medians. `auto vs X` = time of X / time of auto (> 1: auto is faster).",
        "",
        f"Debug recipe (`train.py --job.config_file train_configs/debug_model.toml`, 2 gloo ranks, {args.steps} steps, "
        f"median of {args.rounds} runs per backend; tokens/s = median logged window after the first):",
        "",
        "| backend | tokens/s per rank | wall-clock incl. start-up |",
        "|---|---|---|",
        *(f"| {b} | {r['tps']:.0f} ({r['tps'] / recipe['auto']['tps']:.2f}x of auto) | {r['wall']:.1f} s |"
          for b, r in recipe.items()),
        "",
        f"One packed micro-batch, `debugmodel` forward + backward (tokens/s) and packed attention alone "
        f"(context build + forward + backward), median of {args.repeats} alternating rounds:",
        "",
        "| packing | tokens | model: auto tokens/s | model: auto vs loop | model: auto vs dense | attention: auto ms "
        "| attention: auto vs loop | attention: auto vs dense |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {name} | {tokens} | {tokens / model['auto']:.0f} | {speedups(model)} | {kernel['auto'] * 1e3:.1f} "
          f"| {speedups(kernel)} |" for name, tokens, model, kernel in rows),
        f"| CP share: rank 0 of cp=2, 8 × 512 (2048 queries × 4096 keys) | 2048 | | | "
        f"| {cp_kernel['auto'] * 1e3:.1f} | {speedups(cp_kernel)} |",
        "",
    ]
    publish(lines, write=not args.no_write)


if __name__ == "__main__":
    main()
