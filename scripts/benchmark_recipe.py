"""Measure the figures quoted in docs/benchmarks.md and append them there.

    .venv/bin/python scripts/benchmark.py            # CPU: debug recipe + kernels
    .venv/bin/python scripts/benchmark.py --no-write # print only

1. The embedded default recipe end to end (2 gloo ranks, 200 steps, as `run_train.sh`):
   wall-clock seconds including start-up, and the first and last logged loss.
2. Attention backends on one packed micro-batch (forward + backward), as ratios to
   sdpa_dense measured in the same run, alternating backends to even out machine noise.
3. Chunked cross-entropy vs. full logits: time ratio and the size of the largest logits
   buffer each holds.
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmark_docs import publish  # noqa: E402
from torchtitan_rl.losses.logprobs import token_loss  # noqa: E402
from torchtitan_rl.models.attention import build_attention_context, packed_attention  # noqa: E402


def bench_recipe(num_ranks: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_ranks}",
               "train.py", "--job.config_file", "train_configs/debug_model.toml", "--training.steps", str(steps),
               "--job.dump_folder", dump]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    losses = [float(line.split("loss: ")[1].split()[0]) for line in proc.stderr.splitlines() + proc.stdout.splitlines()
              if " step: " in line and "loss: " in line]
    return {"wall_s": wall, "first_loss": losses[0], "last_loss": losses[-1], "cmd": " ".join(cmd[1:])}


def time_fn(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def bench_attention(lengths: list[int], heads: int, kv_heads: int, head_dim: int, repeats: int) -> dict[str, float]:
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(seq_ids), heads, head_dim, generator=gen, requires_grad=True)
    k = torch.randn(len(seq_ids), kv_heads, head_dim, generator=gen, requires_grad=True)
    v = torch.randn(len(seq_ids), kv_heads, head_dim, generator=gen, requires_grad=True)

    def run(backend):
        def step():
            ctx = build_attention_context(backend, seq_ids, positions)
            packed_attention(q, k, v, ctx).sum().backward()
        return step

    totals = {"sdpa_dense": 0.0, "sdpa_loop": 0.0}
    for _ in range(3):  # interleave so load changes hit both alike
        for backend in totals:
            totals[backend] += time_fn(run(backend), repeats)
    return {b: t / 3 for b, t in totals.items()}


def bench_cross_entropy(num_tokens: int, dim: int, vocab: int, chunk: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, dim, generator=gen, requires_grad=True)
    output = torch.nn.Linear(dim, vocab, bias=False)
    labels = torch.randint(0, vocab, (num_tokens,), generator=gen)

    def full():
        F.cross_entropy(output(hidden).float(), labels, reduction="none").sum().backward()

    def chunked():
        token_loss(hidden, output.weight, labels, chunk, lambda start, end, lp, _: -lp.sum())[0].backward()

    totals = {"full": 0.0, "chunked": 0.0}
    for _ in range(3):
        totals["full"] += time_fn(full, repeats)
        totals["chunked"] += time_fn(chunked, repeats)
    return {k: v / 3 for k, v in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    recipe = bench_recipe(num_ranks=2, steps=200)
    lengths = [300, 17, 120, 64, 500, 33, 250, 1, 400, 90]  # 1775 tokens, uneven like real SFT
    attention = bench_attention(lengths, heads=4, kv_heads=2, head_dim=32, repeats=5)
    ce = bench_cross_entropy(num_tokens=4096, dim=128, vocab=32768, chunk=1024, repeats=2)

    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU only"
    lines = [
        f"## CPU, {datetime.date.today().isoformat()} ({machine})",
        "",
        "Command: `.venv/bin/python scripts/benchmark.py`",
        "",
        f"- Embedded default recipe, 2 gloo ranks, 200 steps (`{recipe['cmd']}`): "
        f"{recipe['wall_s']:.1f} s wall-clock including start-up; loss {recipe['first_loss']:.3f} → {recipe['last_loss']:.3f}.",
        f"- Packed attention forward+backward, {sum(lengths)} tokens in {len(lengths)} sequences, 4 heads / 2 KV heads, "
        f"head_dim 32: sdpa_dense {attention['sdpa_dense'] * 1e3:.1f} ms, sdpa_loop {attention['sdpa_loop'] * 1e3:.1f} ms "
        f"(loop / dense = {attention['sdpa_loop'] / attention['sdpa_dense']:.2f}).",
        f"- Cross-entropy forward+backward, 4096 tokens, dim 128, vocab 32768: full logits {ce['full'] * 1e3:.0f} ms, "
        f"1024-token chunks, gradients taken in forward {ce['chunked'] * 1e3:.0f} ms (chunked / full = {ce['chunked'] / ce['full']:.2f}); "
        f"largest fp32 logits buffer {4096 * 32768 * 4 / 2**20:.0f} MiB vs {1024 * 32768 * 4 / 2**20:.0f} MiB.",
        "",
    ]
    publish(lines, write=not args.no_write)


if __name__ == "__main__":
    main()
