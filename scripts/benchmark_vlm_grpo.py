"""GRPO of the vision-language model, measured: reward and held-out accuracy over several seeds,
and where an RL step's time goes (vision prefill, decoding, training, ...).

    .venv/bin/python scripts/benchmark_vlm_grpo.py            # rewrites its page and figure in docs/benchmarks/
    .venv/bin/python scripts/benchmark_vlm_grpo.py --no-write # print only

Each seed runs ``train_configs/vlm_grpo.toml`` on ``--ranks`` gloo ranks (as ``run_train.sh``
does on CPU). Reported per seed: wall-clock time (SFT warm-up included), the mean reward of the
first and of the last ``WINDOW`` RL steps and their difference, and held-out accuracy (fresh
images never trained on) before RL and at the end: sampled at the recipe's temperature
(``eval/sampled_pass@1``) and greedy (``eval/pass@1``). Over all seeds: the seconds of each phase per
RL step (``time/*_s``); ``generate_prefill`` is the prompts' prefill (their images through the
vision tower once per prompt, then the text) with the first token, ``generate_decode`` the
other tokens. The figure (``scripts/plot_runs.py``'s SVG) shows the mean reward per RL step.
"""

import argparse
import os

from bench_common import add_publish_args, markdown_table, publish, run_train
from plot_runs import svg_figure

RECIPE = "train_configs/vlm_grpo.toml"
PHASES = (
    "weight_sync",
    "generate",
    "generate_prefill",
    "generate_decode",
    "exchange",
    "reward",
    "balance",
    "old_logprobs",
    "train",
    "eval",
)
REWARD = "rl/reward_mean"
WINDOW = 20
FIGURE = "vlm_grpo_reward.svg"


def window_mean(series: dict[int, float], steps: range) -> float:
    return sum(series[i] for i in steps) / len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    add_publish_args(parser, "vlm_grpo")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    rows, phase_sums, num_steps, step_seconds, runs, rises = [], dict.fromkeys(PHASES, 0.0), 0, 0.0, {}, []
    for seed in seeds:
        run = run_train(["--job.config_file", RECIPE, "--debug.seed", str(seed)], ranks=args.ranks)
        s = runs[f"seed {seed}"] = run.scalars
        reward, sampled, greedy = s[REWARD], s["eval/sampled_pass@1"], s["eval/pass@1"]
        last = max(reward)
        first_window, last_window = range(1, WINDOW + 1), range(last - WINDOW + 1, last + 1)
        rise = window_mean(reward, last_window) - window_mean(reward, first_window)
        rises.append(rise)
        rows.append(
            [
                seed,
                f"{run.wall_s:.0f} s",
                f"{window_mean(reward, first_window):.3f}",
                f"{window_mean(reward, last_window):.3f}",
                f"{rise:+.3f}",
                f"{sampled[0]:.3f} → {sampled[last]:.3f}",
                f"{greedy[0]:.3f} → {greedy[last]:.3f}",
            ]
        )
        for phase in PHASES:
            phase_sums[phase] += sum(s.get(f"time/{phase}_s", {}).values())
        num_steps += len(s["time/step_s"])
        step_seconds += sum(s["time/step_s"].values())

    body = [
        (
            f"`{RECIPE}` on {args.ranks} gloo ranks, one run per seed: its SFT warm-up, then its RL steps. Reward is "
            f"the mean over the step's rollouts (1 for a correct answer); `first` / `last` average the first and the "
            f"last {WINDOW} RL steps. Held-out pass@1 is on the recipe's held-out problems (fresh images), before RL "
            "(after the warm-up) → after the last step, sampled at the recipe's temperature and greedy."
        ),
        "",
        *markdown_table(
            [
                "seed",
                "wall-clock",
                f"reward, first {WINDOW}",
                f"last {WINDOW}",
                "rise",
                "held-out sampled pass@1",
                "held-out greedy pass@1",
            ],
            rows,
        ),
        "",
        f"Mean rise over the seeds: {sum(rises) / len(rises):+.3f} (smallest {min(rises):+.3f}).",
        "",
        f"Seconds per RL step (all seeds): {step_seconds / num_steps:.3f}; by phase: "
        + ", ".join(f"{phase} {phase_sums[phase] / num_steps:.3f}" for phase in PHASES if phase_sums[phase])
        + ". `generate` includes `generate_prefill` and `generate_decode`; `eval` is spread over the steps.",
        "",
        f"Figure: [reward per RL step]({FIGURE}).",
    ]
    publish(
        args,
        "GRPO of the vision-language model",
        "Reward and held-out accuracy of `vlm_grpo.toml` over several seeds, and the seconds of an RL step's "
        "phases (vision prefill, decoding, training).",
        body,
    )
    if not args.no_write:
        folder = os.path.dirname(os.path.abspath(args.page))
        with open(os.path.join(folder, FIGURE), "w", encoding="utf-8") as f:
            f.write(svg_figure(runs, [REWARD], title=f"vlm_grpo on {args.ranks} ranks: mean reward per RL step"))


if __name__ == "__main__":
    main()
