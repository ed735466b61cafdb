"""The embedded GRPO recipe, measured: reward curves over several seeds, where a step's time
goes, and two figures of the reward next to the page.

    .venv/bin/python scripts/benchmark_grpo.py            # rewrites its page and figures in docs/benchmarks/
    .venv/bin/python scripts/benchmark_grpo.py --no-write # print only

Each seed runs ``train_configs/debug_grpo.toml`` on ``--ranks`` gloo ranks (as ``run_train.sh``
does on CPU) for ``--steps`` RL steps. Reported per seed: wall-clock time (SFT warm-up included),
mean reward of the first 5 steps, of steps 26-30 (the window tests/integration/test_grpo.py
checks) and of the last 5, and held-out greedy pass@1 at the end; over all seeds: the share of
an RL step spent in each phase (``time/*_s`` summed over steps, over ``time/step_s`` summed).
The figures (``scripts/plot_runs.py``'s SVG) show the mean reward per RL step and against the
seconds of RL steps.
"""

import argparse
import os

from bench_common import ROOT, add_publish_args, markdown_table, publish, run_train
from plot_runs import svg_figure

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

RECIPE = "train_configs/debug_grpo.toml"
PHASES = ("weight_sync", "generate", "exchange", "reward", "reference", "old_logprobs", "train", "eval")
REWARD = "rl/reward_mean"
FIGURES = {"grpo_reward.svg": None, "grpo_reward_vs_time.svg": "time/step_s"}  # file: x tag (None = the step)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    add_publish_args(parser, "grpo")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 30:
        parser.error("--steps must be >= 30: the table reports the mean reward of steps 26-30")

    rows, phase_sums, step_sum, runs = [], dict.fromkeys(PHASES, 0.0), 0.0, {}
    for seed in seeds:
        run = run_train(
            ["--job.config_file", RECIPE, "--training.steps", str(args.steps), "--debug.seed", str(seed)],
            ranks=args.ranks,
        )
        s = runs[f"seed {seed}"] = run.scalars
        reward = s[REWARD]
        rows.append(
            [
                seed,
                f"{run.wall_s:.0f} s",
                f"{sum(s['time/step_s'].values()):.0f} s",
                *(
                    f"{mean([reward[i] for i in window]):.3f}"
                    for window in (range(1, 6), range(26, 31), range(args.steps - 4, args.steps + 1))
                ),
                f"{s['eval/pass@1'][args.steps]:.3f}",
                f"{s['rl/entropy'][args.steps]:.3f}",
            ]
        )
        for phase in PHASES:
            phase_sums[phase] += sum(s.get(f"time/{phase}_s", {}).values())
        step_sum += sum(s["time/step_s"].values())

    with open(os.path.join(ROOT, RECIPE), "rb") as f:
        warmup = tomllib.load(f)["rl"]["sft_warmup_steps"]
    body = [
        (
            f"`{RECIPE}` ({args.steps} RL steps after its {warmup}-step SFT warm-up; 8 arithmetic prompts × 16 "
            f"completions per step, PPO) on {args.ranks} gloo ranks, one run per seed; `RL steps` is the time of the RL "
            "steps alone."
        ),
        "",
        *markdown_table(
            [
                "seed",
                "wall-clock",
                "RL steps",
                "reward, steps 1-5",
                "steps 26-30",
                "last 5",
                "held-out greedy pass@1",
                "entropy",
            ],
            rows,
        ),
        "",
        "Share of RL step time per phase (all seeds): "
        + ", ".join(f"{phase} {phase_sums[phase] / step_sum:.1%}" for phase in PHASES if phase_sums[phase] > 0)
        + ".",
        "",
        "Figures: [reward per step](grpo_reward.svg), [reward vs time](grpo_reward_vs_time.svg).",
    ]
    publish(
        args,
        "GRPO on the embedded recipe",
        "Reward curves of `debug_grpo.toml` over several seeds, held-out "
        "pass@1, and the share of an RL step spent in each phase.",
        body,
    )
    if not args.no_write:
        folder = os.path.dirname(os.path.abspath(args.page))
        for name, x_tag in FIGURES.items():
            against = "per RL step" if x_tag is None else "vs seconds of RL steps (after the SFT warm-up)"
            title = f"debug_grpo on {args.ranks} ranks: mean reward {against}"
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                f.write(svg_figure(runs, [REWARD], x_tag=x_tag, title=title))


if __name__ == "__main__":
    main()
