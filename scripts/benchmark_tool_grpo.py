"""Multi-turn GRPO with a calculator tool: reward, tool calls and held-out pass@1 of
``train_configs/debug_tool_grpo.toml`` over several seeds.

    .venv/bin/python scripts/benchmark_tool_grpo.py            # rewrites its page and figure
    .venv/bin/python scripts/benchmark_tool_grpo.py --no-write # print only

Every run is the recipe as shipped (its SFT warm-up, demonstrations only and then a mix of
demonstrations and direct answers, then ``--steps`` RL steps, evaluation every 10 steps and at
step 0) on 2 gloo ranks, one run per seed. Reported per seed: wall-clock time, the mean reward and tool calls per episode of the
first and last 5 RL steps, held-out greedy pass@1 at step 0 and at the last step, and turns per
episode at the end.
"""

import argparse
import os
import statistics

from bench_common import add_publish_args, markdown_table, publish, run_train
from plot_runs import svg_figure

RECIPE = "train_configs/debug_tool_grpo.toml"
FIGURE = "tool_grpo_reward.svg"
TAGS = ["rl/reward_mean", "rl/observations_mean"]


def window(series: dict[int, float], steps) -> float:
    return statistics.fmean(series[s] for s in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2,3,4")
    parser.add_argument("--steps", type=int, default=30)
    add_publish_args(parser, "tool_grpo")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error("--steps must be >= 10 (first and last 5 steps)")
    rows, runs = [], {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        run = run_train(["--job.config_file", RECIPE, "--training.steps", str(args.steps), "--debug.seed", str(seed)])
        s = run.scalars
        runs[f"seed {seed}"] = s
        first, last = range(1, 6), range(args.steps - 4, args.steps + 1)
        rows.append(
            [
                seed,
                f"{run.wall_s:.0f} s",
                f"{window(s['rl/reward_mean'], first):.2f} → {window(s['rl/reward_mean'], last):.2f}",
                f"{window(s['rl/observations_mean'], first):.2f} → {window(s['rl/observations_mean'], last):.2f}",
                f"{s['eval/pass@1'][0]:.2f} → {s['eval/pass@1'][args.steps]:.2f}",
                f"{s['rl/turns_mean'][args.steps]:.2f}",
            ]
        )
    body = [
        f"`{RECIPE}` ({args.steps} RL steps after its SFT warm-up) on 2 gloo ranks, one run per seed.",
        "",
        *markdown_table(
            [
                "seed",
                "wall-clock",
                "reward, first 5 → last 5 steps",
                "tool calls per episode",
                "held-out greedy pass@1, step 0 → last",
                "turns per episode, last step",
            ],
            rows,
        ),
        "",
        f"Figure: [reward and tool calls per step]({FIGURE}).",
    ]
    publish(
        args,
        "Multi-turn GRPO with a calculator tool",
        "Reward, tool calls and held-out pass@1 of `debug_tool_grpo.toml` over several seeds: the policy learns "
        "to call the calculator and the habit carries over to problems it never saw.",
        body,
    )
    if not args.no_write:
        folder = os.path.dirname(os.path.abspath(args.page))
        title = "debug_tool_grpo, 2 ranks: mean reward and tool calls per RL step"
        with open(os.path.join(folder, FIGURE), "w", encoding="utf-8") as f:
            f.write(svg_figure(runs, TAGS, x_tag=None, title=title))


if __name__ == "__main__":
    main()
