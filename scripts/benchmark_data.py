"""Data at scale, measured: per-rank peak RSS and start-up time on a 1M-row JSONL, 2 ranks.

    git worktree add --detach /tmp/data_before <commit before the change>
    .venv/bin/python scripts/benchmark_data.py --before /tmp/data_before             # rewrites its page
    .venv/bin/python scripts/benchmark_data.py --before /tmp/data_before --no-write  # print only

Writes ``--rows`` chat rows (the SFT ``messages`` format, answers of varying length) to a
JSONL file under /tmp once, then launches 2 rank processes per variant (``RANK`` /
``LOCAL_RANK`` 0 and 1 of one node, no process group: loading is all that is measured).
Each rank loads the rows with ``data.datasets.load_rows``, builds its ``SFTDataLoader`` share
(byte tokenizer) and takes the first mini-batch: start-up is process start to that batch.
Then ``--steps`` steps each run a fixed amount of single-threaded matmuls (``--step-ms`` when
alone; a stand-in for training) and take the next batch: the step time and how long ``next``
waited. Memory, from /proc/self: VmHWM (peak RSS), and at the end RssAnon (private), RssFile
(file pages, shared with every process mapping them) and Pss (shared pages divided among the
processes mapping them). Variants, alternating for ``--repeats`` rounds:

- before: ``--before``'s tree (every rank reads the whole file into Python dicts);
- cold: this tree, empty cache (local rank 0 prepares the Arrow file, rank 1 waits), prefetch;
- warm: this tree, the prepared file re-used, without and with prefetch.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

from bench_common import ROOT, add_publish_args, collect_alternating, launch_env, markdown_table, publish

WORLD_SIZE = 2


def write_dataset(path: str, num_rows: int) -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "token", "model", "rank", "batch", "step", "loss", "data", "cache"]
    with open(path + ".part", "w", encoding="utf-8") as f:
        for i in range(num_rows):
            question = f"Question {i}: what comes after " + " ".join(rng.choices(words, k=rng.randint(3, 12))) + "?"
            answer = " ".join(rng.choices(words, k=rng.randint(5, 40)))
            row = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".part", path)


def memory_kib() -> dict[str, int]:
    """Peak RSS, private and file-backed RSS, and the proportional set size (each shared page
    divided among the processes mapping it) of this process, in KiB."""
    fields = {}
    for path, keys in (("/proc/self/status", ("VmHWM", "RssAnon", "RssFile")), ("/proc/self/smaps_rollup", ("Pss",))):
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    fields[key] = int(value.split()[0])
    return fields


def worker(args) -> None:
    """One rank: load, first batch, then steps; prints one JSON line."""
    sys.path.insert(0, args.tree)
    import inspect

    import torch

    import torchtitan_rl
    from torchtitan_rl.data.datasets import load_rows
    from torchtitan_rl.data.loader import SFTDataLoader
    from torchtitan_rl.data.tokenizer import ByteTokenizer

    assert torchtitan_rl.__file__.startswith(os.path.abspath(args.tree)), torchtitan_rl.__file__
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    load_start = time.time()
    if "cache_dir" in inspect.signature(load_rows).parameters:
        rows = load_rows("", args.dataset, "train", 0, 0, cache_dir=args.cache)
        prefetch = {"prefetch": args.prefetch}
    else:
        rows = load_rows("", args.dataset, "train", 0, 0)
        prefetch = {}
    load_s = time.time() - load_start
    loader = SFTDataLoader(
        rows, ByteTokenizer(), args.seq_len, args.global_batch_size, "truncate", 0, rank, WORLD_SIZE, **prefetch
    )
    next(loader)
    startup_s = time.time() - args.launch_time
    a = torch.randn(256, 256)
    matmuls = 0
    calibrate = time.perf_counter()
    while time.perf_counter() - calibrate < args.step_ms / 1000:
        a = torch.tanh(a @ a)
        matmuls += 1
    waits, steps = [], []
    for _ in range(args.steps):
        step_start = time.perf_counter()
        for _ in range(matmuls):  # the "training step": a fixed amount of work
            a = torch.tanh(a @ a)
        start = time.perf_counter()
        next(loader)
        waits.append(time.perf_counter() - start)
        steps.append(time.perf_counter() - step_start)
    if hasattr(loader, "close"):
        loader.close()
    print(
        json.dumps(
            {
                "rank": rank,
                "startup_s": startup_s,
                "load_s": load_s,
                "wait_ms": 1000 * statistics.median(waits),
                "step_ms": 1000 * statistics.median(steps),
                **memory_kib(),
            }
        )
    )


def launch(tree: str, dataset: str, cache: str, prefetch: bool, args) -> list[dict]:
    launch_time = time.time()
    procs = []
    for rank in range(WORLD_SIZE):
        env = launch_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE)})
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--tree",
            tree,
            "--dataset",
            dataset,
            "--cache",
            cache,
            "--launch-time",
            repr(launch_time),
            "--seq-len",
            str(args.seq_len),
            "--global-batch-size",
            str(args.global_batch_size),
            "--steps",
            str(args.steps),
            "--step-ms",
            str(args.step_ms),
        ]
        if prefetch:
            cmd.append("--prefetch")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"a rank of {tree} failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(results, key=lambda r: r["rank"])


def gib(kib: float) -> str:
    return f"{kib / 2**20:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="", help="a tree of the code before the change (a git worktree)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=200)
    parser.add_argument("--workdir", default="/tmp/benchmark_data")
    add_publish_args(parser, "data")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--launch-time", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--prefetch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    os.makedirs(args.workdir, exist_ok=True)
    dataset = os.path.join(args.workdir, f"chat_{args.rows}.jsonl")
    if not os.path.exists(dataset):
        write_dataset(dataset, args.rows)
    cache = os.path.join(args.workdir, "cache")
    variants = {"cold": (ROOT, True), "warm, no prefetch": (ROOT, False), "warm, prefetch": (ROOT, True)}
    if args.before:
        variants = {"before": (os.path.abspath(args.before), False), **variants}

    def run(name: str) -> list[dict]:
        tree, prefetch = variants[name]
        if name == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        ranks = launch(tree, dataset, cache, prefetch, args)
        print(name, ranks, flush=True)
        return ranks

    # The first round runs cold before the warm variants, which later re-use its prepared file.
    results = collect_alternating({name: (lambda name=name: run(name)) for name in variants}, args.repeats)
    arrow_size = sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache) if f.endswith(".arrow"))

    def median(name: str, rank: int, key: str) -> float:
        return statistics.median(run[rank][key] for run in results[name])

    rows = [
        [
            name,
            rank,
            gib(median(name, rank, "VmHWM")),
            " / ".join(gib(median(name, rank, key)) for key in ("RssAnon", "RssFile", "Pss")),
            f"{median(name, rank, 'startup_s'):.1f} s",
            f"{median(name, rank, 'load_s'):.1f} s",
            f"{median(name, rank, 'step_ms'):.0f} ms / {median(name, rank, 'wait_ms'):.1f} ms",
        ]
        for name in variants
        for rank in range(WORLD_SIZE)
    ]
    body = [
        (
            f"{args.rows:,} chat rows in one JSONL ({os.path.getsize(dataset) / 2**20:.0f} MiB; prepared Arrow file "
            f"{arrow_size / 2**20:.0f} MiB), 2 rank processes of one node, byte tokenizer, global batch "
            f"{args.global_batch_size}, seq_len {args.seq_len}; medians of {args.repeats} alternating rounds. Start-up: "
            f"process start to the first mini-batch. Step: {args.steps} steps of {args.step_ms:.0f} ms of "
            "single-threaded matmuls (when alone) plus `next`; wait: the time in `next`. RssFile pages are shared "
            "(the one Arrow copy in the page cache); Pss divides them among the ranks mapping them. `before` is "
            "`--before`'s tree (here a worktree of the commit before the memory-mapped copy)."
        ),
        "",
        *markdown_table(
            [
                "variant",
                "rank",
                "peak RSS (VmHWM)",
                "RssAnon / RssFile / Pss at end",
                "start-up",
                "of which load_rows",
                "step / wait",
            ],
            rows,
        ),
    ]
    if args.before:
        before = max(median("before", r, "VmHWM") for r in range(WORLD_SIZE))
        warm = max(median("warm, prefetch", r, "VmHWM") for r in range(WORLD_SIZE))
        cold = max(median("cold", r, "VmHWM") for r in range(WORLD_SIZE))
        body += [
            "",
            (
                f"Largest per-rank peak RSS: before {gib(before)}, after {gib(cold)} while preparing (cold) and "
                f"{gib(warm)} re-using ({warm / before:.2f}x). Start-up (slowest rank): before "
                f"{max(median('before', r, 'startup_s') for r in range(WORLD_SIZE)):.1f} s, cold "
                f"{max(median('cold', r, 'startup_s') for r in range(WORLD_SIZE)):.1f} s, warm "
                f"{max(median('warm, prefetch', r, 'startup_s') for r in range(WORLD_SIZE)):.1f} s."
            ),
        ]
    publish(
        args,
        "Data loading at scale",
        "Per-rank peak memory and start-up of 2 ranks loading a 1M-row JSONL: "
        "one memory-mapped Arrow copy per node, with and without prefetch.",
        body,
    )


if __name__ == "__main__":
    main()
