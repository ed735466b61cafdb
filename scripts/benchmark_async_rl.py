"""Colocated GRPO against dedicated rollout ranks at staleness 0, 1 and 2: RL step time, how much
of the generation the trainers no longer wait for, and reward against wall-clock time.

    .venv/bin/python scripts/benchmark_async_rl.py            # rewrites its page and figure
    .venv/bin/python scripts/benchmark_async_rl.py --no-write # print only

Every run is ``train_configs/debug_grpo.toml`` on 2 gloo processes with completions long enough
that generation is a real share of a step (``--generation.max_new_tokens``, default 48, with
``training.seq_len`` raised to fit) for ``--steps`` RL steps after the recipe's SFT warm-up:

- ``colocated``: both ranks train (FSDP over 2) and generate (each its half of the prompts);
- ``rollout K``: ``parallelism.rollout_ranks = 1`` (1 trainer + 1 rollout rank) with
  ``rl.max_staleness = K``; the embedded async recipe ``debug_grpo_async.toml`` is K = 1.

Per variant (steps after the first ``--skip``, which include start-up effects): the median RL
step seconds (``time/step_s`` of the trainers; with rollout ranks a step includes waiting for
its rollouts), the rollout side's generation seconds per step (``time/generate_s``: the rollout
rank's own time for the step's rollouts), the trainers' wait for them
(``time/wait_rollouts_s``), and the overlap fraction 1 - wait / generation: the share of
generation hidden behind training. Speed-ups are ratios of median step times of this
invocation. Reward vs time: the running sum of ``time/step_s`` (RL steps only, after warm-up).
One run per variant, one after the other: read differences of a few percent as noise.
"""

import argparse
import os
import statistics

from bench_common import add_publish_args, markdown_table, publish, run_train
from plot_runs import svg_figure

RECIPE = "train_configs/debug_grpo.toml"
REWARD = "rl/reward_mean"
FIGURE = "async_rl_reward_vs_time.svg"


def variants(max_staleness: list[int]) -> dict[str, list[str]]:
    out = {"colocated": []}
    for k in max_staleness:
        out[f"rollout K={k}"] = ["--parallelism.rollout_ranks", "1", "--rl.max_staleness", str(k)]
    return out


def median_after(series: dict[int, float], skip: int) -> float:
    return statistics.median(v for s, v in series.items() if s > skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3, help="first RL steps left out of the medians")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--staleness", default="0,1,2")
    add_publish_args(parser, "async_rl")
    args = parser.parse_args()
    if args.steps <= args.skip:
        parser.error("--steps must exceed --skip")
    common = [
        "--job.config_file",
        RECIPE,
        "--training.steps",
        str(args.steps),
        "--debug.seed",
        str(args.seed),
        "--generation.max_new_tokens",
        str(args.max_new_tokens),
        "--training.seq_len",
        str(64 + args.max_new_tokens),
        "--rl.eval_interval",
        "0",
    ]
    runs = {
        name: run_train([*common, *extra], ranks=2).scalars
        for name, extra in variants([int(k) for k in args.staleness.split(",")]).items()
    }
    base = median_after(runs["colocated"]["time/step_s"], args.skip)
    rows = []
    for name, scalars in runs.items():
        step = median_after(scalars["time/step_s"], args.skip)
        generate = median_after(scalars["time/generate_s"], args.skip)
        train = median_after(scalars["time/train_s"], args.skip)
        if "time/wait_rollouts_s" in scalars:
            wait = median_after(scalars["time/wait_rollouts_s"], args.skip)
            waited, overlap = f"{wait:.2f}", f"{max(0.0, 1 - wait / generate):.0%}"
        else:
            waited, overlap = "(generates itself)", "0%"
        reward = scalars[REWARD]
        last = range(args.steps - 4, args.steps + 1)
        rows.append(
            [
                name,
                f"{step:.2f} ({base / step:.2f}x)",
                f"{generate:.2f}",
                f"{train:.2f}",
                waited,
                overlap,
                f"{max(scalars.get('rl/staleness_max', {0: 0.0}).values()):.0f}",
                f"{statistics.fmean(reward[s] for s in last):.3f}",
                f"{sum(scalars['time/step_s'].values()):.0f}",
            ]
        )
    body = [
        (
            f"`{RECIPE}` (seed {args.seed}, {args.steps} RL steps after the SFT warm-up) with "
            f"`--generation.max_new_tokens {args.max_new_tokens}` on 2 gloo processes; medians over steps "
            f"{args.skip + 1}-{args.steps}. The script's docstring has the method."
        ),
        "",
        *markdown_table(
            [
                "variant",
                "RL step s (speed-up vs colocated)",
                "generation s",
                "train s",
                "trainer waits s",
                "generation hidden",
                "max lag",
                "reward, last 5",
                "RL steps, total s",
            ],
            rows,
        ),
        "",
        f"Figure: [reward vs seconds of RL steps]({FIGURE}).",
    ]
    publish(
        args,
        "Asynchronous RL: rollout ranks and staleness",
        "Colocated GRPO against 1 trainer + 1 rollout rank at staleness 0, 1 and 2 on the embedded recipe "
        "with long completions: step time, generation hidden behind training, reward against time.",
        body,
    )
    if not args.no_write:
        folder = os.path.dirname(os.path.abspath(args.page))
        title = f"debug_grpo, {args.max_new_tokens} new tokens, 2 processes: mean reward vs seconds of RL steps"
        with open(os.path.join(folder, FIGURE), "w", encoding="utf-8") as f:
            f.write(svg_figure(runs, [REWARD], x_tag="time/step_s", title=title))


if __name__ == "__main__":
    main()
