"""Routing replay on the MoE debug model with a bf16 sampler: the sampler/trainer mismatch, the
share of tokens the correction masks and the reward curve, with replay off and on, over seeds.

    .venv/bin/python scripts/benchmark_routing_replay.py            # rewrites its page and figure
    .venv/bin/python scripts/benchmark_routing_replay.py --no-write # print only

Every run is ``train_configs/debug_grpo.toml`` with ``--model.flavor debugmodel_moe`` (3 MoE
layers of 8 experts, top 2) and ``--moe.aux_loss_coef 0.01`` (without a balancing loss the warm-up
collapses each router onto a few experts, whose margins no rounding flips), and its bf16 sampler
against the float32 trainer, on ``--ranks``
gloo ranks for ``--steps`` RL steps after the recipe's SFT warm-up, with
``--rl.rollout_correction icepop`` (tokens whose ratio pi_prox / pi_sampler leaves [0.5, 2] are
masked: the mask shows the mismatch directly). ``moe.router_replay = "record"`` (the
baseline: the routing is recorded and compared, not replayed) against ``"rollout"`` (replayed
into the proximal and update passes). Per run: the mean reward of the first and the last 5 steps,
and means over the steps of ``moe/routing_agreement`` (the share of the sampler's top-k choices
the trainer's own routing makes), ``rl/rollout_corr/kl_k3`` and
``rl/rollout_corr/masked_fraction_token`` (the mismatch between the trainer's proximal
log-probs and the sampler's). One run per variant and seed. No timings: the runs shared the
machine with other jobs; replay adds one small device-to-host copy per generation step and a
gather per MoE layer.
"""

import argparse
import os
import statistics

from bench_common import add_publish_args, markdown_table, publish, run_train
from plot_runs import svg_figure

RECIPE = "train_configs/debug_grpo.toml"
BASE = [
    *("--model.flavor", "debugmodel_moe", "--moe.aux_loss_coef", "0.01"),
    *("--generation.dtype", "bfloat16", "--rl.rollout_correction", "icepop"),
]
VARIANTS = {"record": ["--moe.router_replay", "record"], "rollout": ["--moe.router_replay", "rollout"]}
REWARD = "rl/reward_mean"
MEAN_TAGS = ("moe/routing_agreement", "rl/rollout_corr/kl_k3", "rl/rollout_corr/masked_fraction_token")


def window_mean(series: dict[int, float], steps) -> float:
    return statistics.fmean(series[s] for s in steps)


def figure(value: float, tag: str) -> str:
    """The agreement as a share; the mismatch and the masked share, which are small, with 3 digits."""
    return f"{value:.4f}" if tag == "moe/routing_agreement" else f"{value:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    add_publish_args(parser, "routing_replay")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 10:
        parser.error("--steps must be >= 10 (first and last 5 steps)")

    rows, curves, sums = [], {}, {name: {tag: [] for tag in (*MEAN_TAGS, "last")} for name in VARIANTS}
    for seed in seeds:
        for name, extra in VARIANTS.items():
            overrides = ["--job.config_file", RECIPE, "--training.steps", str(args.steps), "--debug.seed", str(seed)]
            scalars = run_train([*overrides, *BASE, *extra], ranks=args.ranks).scalars
            curves[f"{name}, seed {seed}"] = scalars
            reward = scalars[REWARD]
            last = window_mean(reward, range(args.steps - 4, args.steps + 1))
            sums[name]["last"].append(last)
            for tag in MEAN_TAGS:
                sums[name][tag].append(statistics.fmean(scalars[tag].values()))
            rows.append(
                [
                    seed,
                    f"`{name}`",
                    f"{window_mean(reward, range(1, 6)):.3f}",
                    f"{last:.3f}",
                    *(figure(statistics.fmean(scalars[tag].values()), tag) for tag in MEAN_TAGS),
                ]
            )
    summary_rows = [
        [f"`{name}`", f"{statistics.fmean(values['last']):.3f}"]
        + [figure(statistics.fmean(values[tag]), tag) for tag in MEAN_TAGS]
        for name, values in sums.items()
    ]
    body = [
        (
            f"`{RECIPE}` with `{' '.join(BASE)}` ({args.steps} RL steps after the SFT warm-up) on {args.ranks} "
            "gloo ranks; `moe.router_replay` `record` (compared, not replayed) against `rollout` (replayed). "
            "The script's docstring has the method."
        ),
        "",
        "### Per run",
        "",
        *markdown_table(
            [
                "seed",
                "moe.router_replay",
                "reward, steps 1-5",
                "last 5",
                *(f"`{t}`" for t in MEAN_TAGS),
            ],
            rows,
        ),
        "",
        f"### Mean over the {len(seeds)} seeds",
        "",
        *markdown_table(["moe.router_replay", "reward, last 5", *(f"`{t}`" for t in MEAN_TAGS)], summary_rows),
        "",
        "Figure: [reward per step](routing_replay_reward.svg).",
    ]
    publish(
        args,
        "Routing replay with a bf16 sampler (MoE)",
        "The MoE debug model's GRPO with a bf16 sampler: routing agreement, mismatch, masked tokens and reward "
        "with the sampler's routing replayed or not.",
        body,
    )
    if not args.no_write:
        folder = os.path.dirname(os.path.abspath(args.page))
        title = f"debug_grpo on debugmodel_moe, bf16 sampler, {args.ranks} ranks: mean reward per RL step"
        with open(os.path.join(folder, "routing_replay_reward.svg"), "w", encoding="utf-8") as f:
            f.write(svg_figure(curves, [REWARD], x_tag=None, title=title))


if __name__ == "__main__":
    main()
