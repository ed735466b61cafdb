"""Rollout generation on a length-skewed workload, before vs after: the generator of a baseline
git ref against the working tree's, on CPU ranks; and the embedded GRPO recipe's step time.

    .venv/bin/python scripts/benchmark_generator.py              # rewrites docs/benchmarks/generator.md
    .venv/bin/python scripts/benchmark_generator.py --no-write   # print only
    .venv/bin/python scripts/benchmark_generator.py --device cuda --rows 64 256 --compile both --json gen.json --no-write

Workload (``scripts/generation_workload.py``): random prompts of ``--prompt-len`` tokens with
``--samples`` samples each, the ``debugmodel`` Qwen3 (random init, fp32), temperature 1. A stop
schedule on the logits makes one row in 8 run to ``--max-new-tokens`` and the others stop after
``--min-short``..``--max-short`` tokens, whatever the weights; which rows are long is drawn
from the generator's own per-row random streams.

Before / after (the default): ``--baseline-ref`` is extracted with ``git archive`` into a
temporary folder and imported from there (PYTHONPATH, checked in each worker); "after" is the
working tree. Each variant runs as ``--ranks`` CPU processes (torchrun, gloo, one thread each),
rank r generating prompts ``r * P .. (r + 1) * P - 1`` (P = ``--prompts-per-rank``) with
``max_prompts_per_batch = --max-prompts-per-batch``. A launch warms up on one batch's prompts,
then times one ``generate`` per rank after a barrier: the launch's time is the slowest rank's,
its tokens the completion tokens of all ranks. Launches alternate between the variants for
``--rounds`` rounds (medians reported). Peak memory: the first launch of each variant runs one
more ``generate`` under the PyTorch profiler (``profile_memory``) and reports, per rank, the
peak of the bytes allocated during it and still alive (``torchtitan_rl.profiling.
cpu_memory_timeline``; the model's weights, allocated before, are not counted). Both variants
must sample the same tokens for every (prompt, sample); the page says how many differ.

GRPO (unless ``--no-grpo``): ``train_configs/debug_grpo.toml`` for ``--grpo-steps`` RL steps on
``--ranks`` ranks from each tree (its own ``train.py``, SFT warm-up included), alternating for
``--grpo-rounds`` rounds: mean ``time/step_s`` and ``time/generate_s`` over the RL steps, and
``rl/reward_mean`` per step (the same rollouts give the same rewards).

``--device cuda|cpu``: one process on that device, no baseline, no torchrun, no GRPO: for each
``--rows`` (rows generated at once: ``max_prompts_per_batch × --samples``; ``--batches`` times
as many prompts are generated) and each ``--compile`` mode (``compile=`` of ``TorchGenerator``),
a warm-up ``generate`` (compiles), then ``--rounds`` alternating timed ones; peak memory is the
CUDA allocator's peak above what was allocated before (on CPU, the profiler's as above). Prints
its table and writes ``--json`` records; it never writes the page.
"""

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import (
    ROOT,
    add_publish_args,
    alternating_order,
    launch_workers,
    markdown_table,
    peak_bytes,
    print_result,
    publish,
    ratio,
    time_alternating,
)
from generation_workload import (
    StopSchedule,
    default_stop_token,
    schedule_mismatches,
    skewed_prompts,
    with_stop_schedule,
)
from grpo_step_compare import grpo_section

TREE_VARIABLE = "GENERATOR_BENCH_TREE"  # the source tree a worker imports torchtitan_rl from
SEED, STEP = 0, 0
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Workload:
    flavor: str
    dtype: str
    attn_backend: str
    prompt_len: int
    samples: int
    max_new_tokens: int
    min_short: int
    max_short: int
    max_prompts_per_batch: int

    def schedule(self, vocab_size: int) -> StopSchedule:
        stop = default_stop_token(vocab_size)
        return StopSchedule(self.prompt_len, stop, min_short=self.min_short, max_short=self.max_short)


def build_generator(workload: Workload, device, compile_mode: bool | None):
    """(generator under the stop schedule, sampling params, schedule); ``compile_mode`` None:
    the generator's default (a generator without the ``compile`` argument)."""
    import torch

    from torchtitan_rl.models.qwen3.args import qwen3_flavors
    from torchtitan_rl.models.qwen3.model import Qwen3Model
    from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator

    args = dataclasses.replace(qwen3_flavors[workload.flavor], attn_backend=workload.attn_backend)
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    schedule = workload.schedule(args.vocab_size)
    kwargs = {} if compile_mode is None else {"compile": compile_mode}
    gen = with_stop_schedule(TorchGenerator, schedule)(
        args, device, getattr(torch, workload.dtype), max_prompts_per_batch=workload.max_prompts_per_batch, **kwargs
    )
    gen.update_weights(model)
    params = SamplingParams(workload.max_new_tokens, temperature=1.0, stop_token_ids=(schedule.stop_token,))
    return gen, params, schedule


# ------------------------------------------------------------------------- before / after on CPU ranks


def worker(config: dict) -> None:
    """One rank of a before / after launch: generate this rank's share, report to rank 0."""
    tree = os.environ[TREE_VARIABLE]
    sys.path.insert(0, tree)  # ahead of the checkout bench_common put first
    import torch
    import torch.distributed as dist

    import torchtitan_rl

    imported = os.path.dirname(os.path.dirname(os.path.abspath(torchtitan_rl.__file__)))
    if not os.path.samefile(imported, tree):
        raise RuntimeError(f"torchtitan_rl was imported from {imported}, not from {tree}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = Workload(**config["workload"])
    device = torch.device("cpu")
    gen, params, schedule = build_generator(workload, device, None)
    num = config["prompts_per_rank"]
    prompts = skewed_prompts(num * world, workload.prompt_len, gen.args.vocab_size, SEED)[rank * num : (rank + 1) * num]
    indices = list(range(rank * num, (rank + 1) * num))

    def run(count: int = num):
        return gen.generate(prompts[:count], indices[:count], workload.samples, params, SEED, STEP)

    run(workload.max_prompts_per_batch)  # warm-up
    dist.barrier()
    start = time.perf_counter()
    rollouts = run()
    seconds = time.perf_counter() - start
    peak = peak_bytes(run, device) if config["profile_memory"] else None
    mine = {
        "seconds": seconds,
        "peak_bytes": peak,
        "mismatches": schedule_mismatches(rollouts, schedule, workload.max_new_tokens),
        "tokens": {f"{r.prompt_index},{r.sample_index}": r.completion_tokens for r in rollouts},
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        print_result(
            {
                "seconds": [g["seconds"] for g in gathered],
                "peak_bytes": [g["peak_bytes"] for g in gathered],
                "mismatches": sum(g["mismatches"] for g in gathered),
                "tokens": {key: tokens for g in gathered for key, tokens in g["tokens"].items()},
            }
        )
    dist.destroy_process_group()


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def extract_tree(ref: str, folder: str) -> str:
    """``git archive REF`` unpacked into ``folder``; REF's short commit hash."""
    try:
        commit = git("rev-parse", "--verify", "--short", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError as err:
        raise ValueError(f"--baseline-ref {ref!r} is not a commit of {ROOT}") from err
    archive = subprocess.Popen(["git", "archive", commit], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", folder], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed (exit status {archive.returncode})")
    return commit


def working_tree_label() -> str:
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, check=False).returncode != 0
    return f"working tree ({git('rev-parse', '--short', 'HEAD')}{' + uncommitted changes' if dirty else ''})"


def compare_trees(args, workload: Workload, baseline: str) -> dict[str, list[dict]]:
    """``{variant: [a launch's result, one per round]}``, launches alternating."""
    trees = {"before": baseline, "after": ROOT}
    results = {name: [] for name in trees}
    for order in alternating_order(list(trees), args.rounds):
        for name in order:
            config = {
                "workload": dataclasses.asdict(workload),
                "prompts_per_rank": args.prompts_per_rank,
                "profile_memory": not results[name],
            }
            env = {TREE_VARIABLE: trees[name], "PYTHONPATH": trees[name]}
            result = launch_workers(__file__, args.ranks, ["--config", json.dumps(config)], env=env)
            done = result["error"] if "error" in result else f"{max(result['seconds']):.2f} s"
            print(f"{name}: {done}", file=sys.stderr, flush=True)
            results[name].append(result)
    return results


def tree_rows(results: dict[str, list[dict]], labels: dict[str, str]) -> tuple[list[list], dict[str, float]]:
    """Table rows and tokens/s per variant (absent when a launch failed)."""
    rows, throughput = [], {}
    for name, runs in results.items():
        failed = [r["error"] for r in runs if "error" in r]
        if failed:
            rows.append([labels[name], "—", "—", "—", f"failed: {failed[0]}"])
            continue
        tokens = sum(len(t) for t in runs[0]["tokens"].values())
        seconds = statistics.median(max(r["seconds"]) for r in runs)
        throughput[name] = tokens / seconds
        peaks = ", ".join(f"{p / MIB:.1f}" for p in runs[0]["peak_bytes"])
        rows.append([labels[name], tokens, f"{seconds:.2f} s", f"{throughput[name]:.0f}", f"{peaks} MiB"])
    return rows, throughput


def tree_body(args, workload: Workload, results: dict[str, list[dict]], labels: dict[str, str]) -> list[str]:
    rows, throughput = tree_rows(results, labels)
    num_rows = args.ranks * args.prompts_per_rank * workload.samples
    body = [
        (
            f"`debugmodel` Qwen3 ({workload.dtype}, random init), {args.ranks} CPU ranks (gloo, one thread each), "
            f"{args.prompts_per_rank} prompts of {workload.prompt_len} tokens × {workload.samples} samples per rank "
            f"({num_rows} rows in all), `max_prompts_per_batch` {workload.max_prompts_per_batch}, temperature 1. "
            f"Stop schedule (`scripts/generation_workload.py`): one row in 8 runs to {workload.max_new_tokens} new "
            f"tokens, the others stop after {workload.min_short}..{workload.max_short}. Time: one `generate` per rank "
            f"after a warm-up batch, the slowest rank's, median of {args.rounds} alternating launches per variant. "
            "Peak memory per rank: bytes allocated during one `generate` and still alive (PyTorch profiler, "
            "`profile_memory`), weights excluded."
        ),
        "",
        *markdown_table(["generator", "tokens", "time", "tokens/s", "peak memory per rank"], rows),
        "",
    ]
    if len(throughput) == 2:
        body.append(
            f"- after / before throughput: {ratio(throughput['after'], throughput['before'])} (goal: at least 2.5x)."
        )
        first = {name: runs[0] for name, runs in results.items()}
        before, after = first["before"]["tokens"], first["after"]["tokens"]
        differ = sum(before.get(key) != after.get(key) for key in before.keys() | after.keys())
        lengths = [len(t) for t in before.values()]
        num_long = sum(n == workload.max_new_tokens for n in lengths)
        body += [
            f"- (prompt, sample) rows whose tokens differ between before and after: {differ} of {len(before)}.",
            f"- rows off the stop schedule: before {first['before']['mismatches']}, after "
            f"{first['after']['mismatches']}; rows at {workload.max_new_tokens} tokens: {num_long} of {len(lengths)}, "
            f"mean completion length {statistics.mean(lengths):.1f}.",
        ]
    return body


# ------------------------------------------------------------------------- one device


def device_main(args, workload_for) -> None:
    import torch

    from torchtitan_rl.rl.generator import TorchGenerator

    device = torch.device(args.device)
    takes_compile = "compile" in inspect.signature(TorchGenerator.__init__).parameters
    modes = ["eager", "compiled"] if args.compile == "both" else [args.compile]
    if "compiled" in modes and not takes_compile:
        raise SystemExit(
            "--compile compiled/both: this tree's TorchGenerator takes no compile= argument (no compiled decode step)"
        )
    records, table = [], []
    for rows in args.rows:
        if rows % args.samples:
            raise SystemExit(f"--rows {rows} is not a multiple of --samples {args.samples}")
        workload = workload_for(rows // args.samples)
        num_prompts = workload.max_prompts_per_batch * args.batches
        generators = {
            mode: build_generator(workload, device, (mode == "compiled") if takes_compile else None) for mode in modes
        }
        gen, params, schedule = next(iter(generators.values()))
        prompts = skewed_prompts(num_prompts, workload.prompt_len, gen.args.vocab_size, SEED)
        runs = {
            mode: (lambda g=g: g.generate(prompts, list(range(num_prompts)), args.samples, params, SEED, STEP))
            for mode, (g, _, _) in generators.items()
        }
        outputs = {mode: run() for mode, run in runs.items()}  # warm-up (compiles every bucket)
        median = time_alternating(runs, args.rounds, warmup=0)
        peaks = {mode: peak_bytes(run, device) for mode, run in runs.items()}
        eager = [r.completion_tokens for r in outputs["eager"]] if "eager" in outputs else None
        for mode in modes:
            tokens = sum(len(r.completion_tokens) for r in outputs[mode])
            differ = None if eager is None else sum(a != r.completion_tokens for a, r in zip(eager, outputs[mode]))
            records.append(
                {
                    "rows": rows,
                    "compile": mode,
                    "tokens_per_s": tokens / median[mode],
                    "peak_memory_bytes": peaks[mode],
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "generated_tokens": tokens,
                    "seconds": median[mode],
                    "rows_off_schedule": schedule_mismatches(outputs[mode], schedule, workload.max_new_tokens),
                    "rows_differing_from_eager": differ,
                }
            )
            table.append(
                [
                    rows,
                    mode,
                    tokens,
                    f"{median[mode]:.2f} s",
                    f"{tokens / median[mode]:.0f}",
                    f"{peaks[mode] / MIB:.1f} MiB",
                    "—" if differ is None else differ,
                ]
            )
        del generators, runs, outputs
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1)
    print(
        "\n".join(
            markdown_table(
                ["rows", "compile", "tokens", "time", "tokens/s", "peak memory", "rows differing from eager"],
                table,
            )
        )
    )


# ------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--baseline-ref", default="fb8b539", help="git ref of the 'before' generator")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts-per-rank", type=int, default=32)
    parser.add_argument("--max-prompts-per-batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the long rows' length")
    parser.add_argument("--min-short", type=int, default=8, help="the shortest class's length")
    parser.add_argument("--max-short", type=int, default=32, help="the longest short class's length")
    parser.add_argument("--flavor", default="debugmodel", help="Qwen3 flavor (random init)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the generator's dtype")
    parser.add_argument("--attn-backend", default="sdpa_dense", help="prefill attention backend")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-grpo", action="store_true", help="skip the GRPO step-time comparison")
    parser.add_argument("--grpo-steps", type=int, default=6)
    parser.add_argument("--grpo-rounds", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], help="one process on this device (see above)")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="--device: rows generated at once")
    parser.add_argument("--batches", type=int, default=4, help="--device: prompts generated, in batches of --rows")
    parser.add_argument("--compile", choices=["both", "eager", "compiled"], default="eager", help="--device only")
    parser.add_argument("--json", help="--device: write the records here")
    add_publish_args(parser, "generator")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.config))
        return

    def workload_for(max_prompts_per_batch: int) -> Workload:
        return Workload(
            args.flavor,
            args.dtype,
            args.attn_backend,
            args.prompt_len,
            args.samples,
            args.max_new_tokens,
            args.min_short,
            args.max_short,
            max_prompts_per_batch,
        )

    if args.device is not None:
        device_main(args, workload_for)
        return
    workload = workload_for(args.max_prompts_per_batch)
    with tempfile.TemporaryDirectory(prefix="generator_baseline_") as baseline:
        commit = extract_tree(args.baseline_ref, baseline)
        labels = {"before": f"before: `{commit}`", "after": f"after: {working_tree_label()}"}
        results = compare_trees(args, workload, baseline)
        body = tree_body(args, workload, results, labels)
        if not args.no_grpo:
            body += [
                "",
                *grpo_section(
                    {"before": baseline, "after": ROOT}, labels, args.ranks, args.grpo_steps, args.grpo_rounds
                ),
            ]
    publish(
        args,
        "Rollout generator: length-skewed workload, before vs after",
        "Generated tokens per second and peak memory of `TorchGenerator` on a workload where one row in 8 runs "
        f"to {args.max_new_tokens} new tokens and the rest stop within {args.max_short}, a baseline commit against "
        "the working tree" + ("" if args.no_grpo else "; the embedded GRPO recipe's step time from both") + ".",
        body,
    )


if __name__ == "__main__":
    main()
