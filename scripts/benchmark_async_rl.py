"""Colocated GRPO against dedicated rollout ranks at staleness 0, 1 and 2: RL step time, how much
of the generation the trainers no longer wait for, and reward against wall-clock time.

    .venv/bin/python scripts/benchmark_async_rl.py            # rewrites its page and figure
    .venv/bin/python scripts/benchmark_async_rl.py --no-write # print only

Every run is ``train_configs/debug_grpo.toml`` on 2 gloo processes with
``--generation.max_new_tokens`` (default 48, ``training.seq_len`` raised to fit), as

- ``colocated``: both ranks train (FSDP over 2) and generate (each its half of the prompts);
- ``rollout K``: ``parallelism.rollout_ranks = 1`` (1 trainer + 1 rollout rank) with
  ``rl.max_staleness = K``; the embedded async recipe ``debug_grpo_async.toml`` is K = 1.

Step time (``--timing-steps`` RL steps, no SFT warm-up): the untrained model rarely stops, so
nearly every completion is ``max_new_tokens`` long and generation is a real share of a step, as
with long reasoning traces; its rewards are all 0, the work per step is a real RL step's.
Medians over the steps after the first ``--skip``: the trainers' RL step seconds
(``time/step_s``; with rollout ranks it includes waiting for the step's rollouts), the
generation seconds per step (``time/generate_s``; with rollout ranks the rollout rank's own
time for the whole step), the update's (``time/train_s`` + ``time/old_logprobs_s``), the
trainers' wait for rollouts (``time/wait_rollouts_s``) and the overlap fraction
1 - wait / generation (the share of generation hidden behind training). Speed-ups are ratios
of median step times in this invocation.

Reward against time (``--steps`` RL steps after the recipe's SFT warm-up, seed ``--seed``): the
mean reward of the last 5 steps, the seconds of all RL steps, and the figure (reward against the
running sum of ``time/step_s``). The warmed-up model answers in a few tokens, so here generation
is a small share whatever ``max_new_tokens`` allows.

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
    """The median of ``series`` over the steps after ``skip``."""
    return statistics.median(v for s, v in series.items() if s > skip)


def timing_row(name: str, scalars: dict, skip: int, base: float) -> list[str]:
    step = median_after(scalars["time/step_s"], skip)
    generate = median_after(scalars["time/generate_s"], skip)
    update = median_after(scalars["time/train_s"], skip) + median_after(scalars["time/old_logprobs_s"], skip)
    if "time/wait_rollouts_s" in scalars:
        wait = median_after(scalars["time/wait_rollouts_s"], skip)
        waited, hidden = f"{wait:.2f}", f"{max(0.0, 1 - wait / generate):.0%}"
    else:
        waited, hidden = "(generates itself)", "0%"
    length = statistics.fmean(scalars["rl/response_length_mean"].values())
    return [
        name,
        f"{step:.2f} ({base / step:.2f}x)",
        f"{generate:.2f}",
        f"{update:.2f}",
        waited,
        hidden,
        f"{length:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="RL steps of the reward runs")
    parser.add_argument("--timing-steps", type=int, default=12, help="RL steps of the timing runs")
    parser.add_argument("--skip", type=int, default=2, help="first RL steps left out of the timing medians")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--staleness", default="0,1,2")
    add_publish_args(parser, "async_rl")
    args = parser.parse_args()
    if args.timing_steps <= args.skip or args.steps < 5:
        parser.error("--timing-steps must exceed --skip, and --steps be at least 5")
    common = [
        "--job.config_file",
        RECIPE,
        "--debug.seed",
        str(args.seed),
        "--generation.max_new_tokens",
        str(args.max_new_tokens),
        "--training.seq_len",
        str(64 + args.max_new_tokens),
        "--rl.eval_interval",
        "0",
    ]
    named = variants([int(k) for k in args.staleness.split(",")])
    timing_overrides = ["--training.steps", str(args.timing_steps), "--rl.sft_warmup_steps", "0"]
    timing = {name: run_train([*common, *timing_overrides, *extra], ranks=2).scalars for name, extra in named.items()}
    runs = {
        name: run_train([*common, "--training.steps", str(args.steps), *extra], ranks=2).scalars
        for name, extra in named.items()
    }
    base = median_after(timing["colocated"]["time/step_s"], args.skip)
    timing_rows = [timing_row(name, scalars, args.skip, base) for name, scalars in timing.items()]
    base_total = sum(runs["colocated"]["time/step_s"].values())
    reward_rows = []
    for name, scalars in runs.items():
        reward, total = scalars[REWARD], sum(scalars["time/step_s"].values())
        last = range(args.steps - 4, args.steps + 1)
        reward_rows.append(
            [
                name,
                f"{statistics.fmean(reward[s] for s in range(1, 6)):.3f}",
                f"{statistics.fmean(reward[s] for s in last):.3f}",
                f"{max(scalars.get('rl/staleness_max', {0: 0.0}).values()):.0f}",
                f"{total:.1f} ({base_total / total:.2f}x)",
            ]
        )
    body = [
        (
            f"`{RECIPE}` with `--generation.max_new_tokens {args.max_new_tokens}` on 2 gloo processes. The "
            "script's docstring has the method."
        ),
        "",
        f"### Step time with long completions ({args.timing_steps} RL steps from the untrained model, "
        f"medians of steps {args.skip + 1}-{args.timing_steps})",
        "",
        *markdown_table(
            [
                "variant",
                "RL step s (speed-up vs colocated)",
                "generation s",
                "update s",
                "trainer waits s",
                "generation hidden",
                "completion tokens",
            ],
            timing_rows,
        ),
        "",
        f"### Reward against time (seed {args.seed}, {args.steps} RL steps after the SFT warm-up)",
        "",
        *markdown_table(
            ["variant", "reward, steps 1-5", "last 5", "max lag", "RL steps, total s (speed-up)"], reward_rows
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
