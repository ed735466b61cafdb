"""A recipe end to end through ``train.py``: wall-clock, throughput, loss and peak memory, for
one or more variants of it run alternately.

    .venv/bin/python scripts/benchmark_recipe.py              # the embedded recipe, 2 ranks, 200 steps
    .venv/bin/python scripts/benchmark_recipe.py --steps 100 --rounds 3 \\
        --variant dense="--model.attn_backend sdpa_dense" --variant loop="--model.attn_backend sdpa_loop"
    .venv/bin/python scripts/benchmark_recipe.py --no-write   # print the page only

Each variant is ``train.py --job.config_file CONFIG --training.steps STEPS [OVERRIDES]`` on
``--ranks`` processes (torchrun; ``--ranks 0`` runs plain python), ``--rounds`` times, the
variants alternating; the figures are medians over the rounds, read from the run's TensorBoard
scalars: tokens/s per rank (the median logged window after the first, which holds the
start-up), the first and last logged loss, and the largest peak memory per rank. Ratios are
to the first variant.
"""

import argparse
import shlex
import statistics

from bench_common import TrainRun, add_publish_args, collect_alternating, markdown_table, publish, ratio, run_train

LOSS_TAG, TPS_TAG = "loss_metrics/global_avg_loss", "throughput(tps)"
MEMORY_TAGS = ("memory/max_active(GiB)", "memory/peak_rss(GiB)")  # CUDA, CPU


def figures(run: TrainRun) -> dict[str, float]:
    tps = run.series(TPS_TAG)
    windows = [tps[step] for step in sorted(tps)][1:] or list(tps.values())
    first, last = run.first_last(LOSS_TAG)
    memory = next(run.scalars[tag] for tag in MEMORY_TAGS if tag in run.scalars)
    return {
        "wall_s": run.wall_s,
        "tps": statistics.median(windows),
        "first_loss": first,
        "last_loss": last,
        "memory_gib": max(memory.values()),
    }


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f'--variant {text!r}: expected NAME="--key value ..."')
    return name, shlex.split(overrides)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/debug_model.toml")
    parser.add_argument("--ranks", type=int, default=2, help="processes (torchrun); 0 runs plain python")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1, help="runs per variant, alternating")
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        help='NAME="OVERRIDES" (repeatable; default: the recipe as it is)',
    )
    add_publish_args(parser, "recipe")
    args = parser.parse_args()
    if len({name for name, _ in args.variant}) != len(args.variant):
        parser.error("--variant names must be distinct")
    variants = dict(args.variant) or {"recipe": []}
    base = ["--job.config_file", args.config, "--training.steps", str(args.steps)]
    ranks = args.ranks or None

    launches = {
        name: (lambda extra=extra: figures(run_train([*base, *extra], ranks=ranks))) for name, extra in variants.items()
    }
    runs = collect_alternating(launches, args.rounds)
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    first = medians[next(iter(medians))]
    rows = [
        [
            name,
            f"`{shlex.join(variants[name])}`" if variants[name] else "—",
            f"{m['wall_s']:.1f} s ({ratio(m['wall_s'], first['wall_s'])})",
            f"{m['tps']:.0f} ({ratio(m['tps'], first['tps'])})",
            f"{m['first_loss']:.3f} → {m['last_loss']:.3f}",
            f"{m['memory_gib']:.2f} GiB",
        ]
        for name, m in medians.items()
    ]
    launch = f"{args.ranks} ranks (torchrun)" if ranks else "one process (python)"
    body = [
        (
            f"`{args.config}` for {args.steps} steps on {launch}, median of {args.rounds} alternating run(s) per "
            "variant; tokens/s per rank is the median logged window after the first:"
        ),
        "",
        *markdown_table(
            [
                "variant",
                "overrides",
                "wall-clock incl. start-up",
                "tokens/s per rank",
                "loss, first → last logged",
                "peak memory per rank",
            ],
            rows,
        ),
    ]
    publish(
        args,
        "A recipe end to end",
        "Wall-clock, tokens/s, loss and peak memory of a recipe run through "
        "`train.py`, for variants of it run alternately.",
        body,
    )


if __name__ == "__main__":
    main()
