"""The embedded reward-model recipe, measured: held-out pair accuracy over several seeds.

    .venv/bin/python scripts/benchmark_reward_model.py             # rewrites docs/benchmarks/reward_model.md
    .venv/bin/python scripts/benchmark_reward_model.py --no-write  # print only

Each seed runs ``train_configs/debug_rm.toml`` (a Bradley–Terry reward model of the tiny Qwen3
on arithmetic pairs whose chosen answer is right and whose rejected one a near miss, evaluated
on 128 held-out pairs every ``preference.eval_interval`` steps) on ``--ranks`` gloo ranks, as
shipped. Reported per seed: wall-clock time (start-up and the final export included) and the
held-out ``eval/rm/accuracy`` and ``eval/loss`` at every evaluation.
"""

import argparse

from bench_common import add_publish_args, markdown_table, publish, run_train

RECIPE = "train_configs/debug_rm.toml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    add_publish_args(parser, "reward_model")
    args = parser.parse_args()
    runs = {
        seed: run_train(["--job.config_file", RECIPE, "--debug.seed", str(seed)], ranks=args.ranks)
        for seed in (int(s) for s in args.seeds.split(","))
    }
    steps = sorted(next(iter(runs.values())).series("eval/rm/accuracy"))
    rows = [
        [seed, f"{run.wall_s:.0f} s"]
        + [f"{run.series('eval/rm/accuracy')[step]:.3f}" for step in steps]
        + [f"{run.series('eval/loss')[steps[0]]:.3f} → {run.series('eval/loss')[steps[-1]]:.3f}"]
        for seed, run in runs.items()
    ]
    body = [
        f"`{RECIPE}` as shipped on {args.ranks} rank(s), from scratch; `eval/rm/accuracy` (share of the 128 "
        "held-out pairs whose chosen completion scores higher) at each evaluation step.",
        "",
        *markdown_table(["seed", "wall", *(f"step {step}" for step in steps), "eval/loss"], rows),
    ]
    publish(
        args,
        "Reward model: the embedded recipe",
        "Held-out pair accuracy of debug_rm.toml at every evaluation, over seeds, and its wall-clock time.",
        body,
    )


if __name__ == "__main__":
    main()
