"""Rollout correction and GSPO on the embedded GRPO recipe with a bf16 sampler: reward curves
over several seeds, and the step-time cost of each correction and of GSPO.

    .venv/bin/python scripts/benchmark_rollout_correction.py            # rewrites its page and figure
    .venv/bin/python scripts/benchmark_rollout_correction.py --no-write # print only

Every run is ``train_configs/debug_grpo.toml`` with ``--generation.dtype bfloat16`` (the sampler's
replica in bf16 against the float32 trainer: a real mismatch) on ``--ranks`` gloo ranks for
``--steps`` RL steps. Reward curves: ``rl.rollout_correction`` none / tis / mis, one run per seed;
per run the mean reward of the first and the last 5 steps, and the mismatch it corrected
(``rl/rollout_corr/kl_k3``, ``rl/sampler_logprob_diff_mean``, ``rl/rollout_corr/masked_fraction_token``,
means over the steps). Cost: with the first seed, each correction and GSPO (``loss.loss_fn =
"gspo"``, ``loss.reduction = "sequence_mean"``) against plain PPO without correction: the seconds
of the RL steps (``time/step_s`` summed) and of their updates (``time/train_s`` +
``time/old_logprobs_s``, the pass a correction adds), as ratios to plain PPO's of the same seed.
One run per variant, one after the other (not medians of alternating rounds): on a shared
machine, read differences of a few percent as noise.
"""

import argparse
import os
import statistics

from bench_common import add_publish_args, markdown_table, publish, run_train
from plot_runs import svg_figure

RECIPE = "train_configs/debug_grpo.toml"
BF16 = ["--generation.dtype", "bfloat16"]
# Named on the command line each time: the embedded recipe itself corrects with TIS.
CURVES = {
    "none": ["--rl.rollout_correction", "none"],
    "tis": ["--rl.rollout_correction", "tis"],
    "mis": ["--rl.rollout_correction", "mis"],
}
COST_ONLY = {
    "icepop": ["--rl.rollout_correction", "icepop"],
    "geo_mask": ["--rl.rollout_correction", "geo_mask", "--rl.rollout_correction_level", "sequence"],
    # The recipe sets PPO's clip bounds; GSPO gets its own (the paper's).
    "gspo": [
        "--loss.loss_fn",
        "gspo",
        "--loss.reduction",
        "sequence_mean",
        "--loss.clip_low",
        "3e-4",
        "--loss.clip_high",
        "4e-4",
    ],
}
REWARD = "rl/reward_mean"
MISMATCH_TAGS = ("rl/rollout_corr/kl_k3", "rl/sampler_logprob_diff_mean", "rl/rollout_corr/masked_fraction_token")


def window_mean(series: dict[int, float], steps) -> float:
    return statistics.fmean(series[s] for s in steps)


def series_mean(scalars: dict, tag: str) -> str:
    return f"{statistics.fmean(scalars[tag].values()):.4f}" if tag in scalars else "-"


def seconds(scalars: dict, *tags: str) -> float:
    return sum(sum(scalars.get(tag, {}).values()) for tag in tags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    add_publish_args(parser, "rollout_correction")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 10:
        parser.error("--steps must be >= 10 (first and last 5 steps)")

    def launch(seed: int, extra: list[str]):
        overrides = ["--job.config_file", RECIPE, "--training.steps", str(args.steps), "--debug.seed", str(seed)]
        return run_train([*overrides, *BF16, *extra], ranks=args.ranks).scalars

    curve_rows, curves, first_seed = [], {}, {}
    for seed in seeds:
        for name, extra in CURVES.items():
            scalars = launch(seed, extra)
            curves[f"{name}, seed {seed}"] = scalars
            if seed == seeds[0]:
                first_seed[name] = scalars
            reward = scalars[REWARD]
            curve_rows.append(
                [
                    seed,
                    f"`{name}`",
                    f"{window_mean(reward, range(1, 6)):.3f}",
                    f"{window_mean(reward, range(args.steps - 4, args.steps + 1)):.3f}",
                    *(series_mean(scalars, tag) for tag in MISMATCH_TAGS),
                ]
            )
    for name, extra in COST_ONLY.items():
        first_seed[name] = launch(seeds[0], extra)
    base_step = seconds(first_seed["none"], "time/step_s")
    base_update = seconds(first_seed["none"], "time/train_s", "time/old_logprobs_s")
    cost_rows = [
        [
            f"`{name}`",
            f"{seconds(s, 'time/step_s'):.1f} s ({seconds(s, 'time/step_s') / base_step:.2f}x)",
            f"{seconds(s, 'time/train_s', 'time/old_logprobs_s'):.1f} s "
            f"({seconds(s, 'time/train_s', 'time/old_logprobs_s') / base_update:.2f}x)",
        ]
        for name, s in first_seed.items()
    ]
    body = [
        (
            f"`{RECIPE}` with `--generation.dtype bfloat16` ({args.steps} RL steps after the SFT warm-up) on "
            f"{args.ranks} gloo ranks. The script's docstring has the method."
        ),
        "",
        "### Reward and mismatch",
        "",
        *markdown_table(
            ["seed", "rl.rollout_correction", "reward, steps 1-5", "last 5", *(f"`{t}`" for t in MISMATCH_TAGS)],
            curve_rows,
        ),
        "",
        "Figure: [reward per step](rollout_correction_reward.svg).",
        "",
        f"### Cost (seed {seeds[0]}, ratios to `none`; one run each)",
        "",
        *markdown_table(["variant", "RL steps", "updates (+ proximal pass)"], cost_rows),
    ]
    publish(
        args,
        "Rollout correction and GSPO with a bf16 sampler",
        "Reward curves of `debug_grpo.toml` with a bf16 sampler, without correction and with TIS and "
        "MIS, and the step-time cost of every correction and of GSPO.",
        body,
    )
    if not args.no_write:
        folder = os.path.dirname(os.path.abspath(args.page))
        title = f"debug_grpo, bf16 sampler, {args.ranks} ranks: mean reward per RL step"
        with open(os.path.join(folder, "rollout_correction_reward.svg"), "w", encoding="utf-8") as f:
            f.write(svg_figure(curves, [REWARD], x_tag=None, title=title))


if __name__ == "__main__":
    main()
