"""The embedded GRPO recipe run from two source trees (a baseline commit's and the working tree),
compared: RL step time, generation time and the rewards of every step. A section of
``scripts/benchmark_generator.py``'s page."""

import statistics
import sys

from bench_common import alternating_order, markdown_table, ratio, run_train

RECIPE = "train_configs/debug_grpo.toml"
STEP_TIME, GENERATE_TIME, REWARD = "time/step_s", "time/generate_s", "rl/reward_mean"


def run_recipe(tree: str, ranks: int, steps: int) -> dict[str, dict[int, float]]:
    """The recipe's TensorBoard scalars after ``steps`` RL steps, run with ``tree``'s own
    ``train.py`` and package; RuntimeError with the output's tail when it fails."""
    overrides = ["--job.config_file", RECIPE, "--training.steps", str(steps)]
    return run_train(overrides, ranks, env={"PYTHONPATH": tree}, root=tree).scalars


def _error_line(err: RuntimeError) -> str:
    lines = str(err).splitlines()
    errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line]
    return (errors or lines)[-1].strip()[:200]


def grpo_section(trees: dict[str, str], labels: dict[str, str], ranks: int, steps: int, rounds: int) -> list[str]:
    """Markdown lines comparing the recipe run from each of ``trees`` (variant -> folder),
    ``rounds`` alternating runs per variant."""
    runs: dict[str, list] = {name: [] for name in trees}
    for order in alternating_order(list(trees), rounds):
        for name in order:
            try:
                runs[name].append(run_recipe(trees[name], ranks, steps))
            except RuntimeError as err:
                print(f"warning: the GRPO recipe failed for {name}: {err}", file=sys.stderr, flush=True)
                runs[name].append(_error_line(err))
            print(f"GRPO {name}: done", file=sys.stderr, flush=True)
    rows, step_means, generate_means, rewards = [], {}, {}, {}
    for name, results in runs.items():
        failed = [r for r in results if isinstance(r, str)]
        if failed:
            rows.append([labels[name], "—", "—", f"failed: {failed[0]}"])
            continue
        step_means[name] = statistics.median(statistics.mean(r[STEP_TIME].values()) for r in results)
        generate_means[name] = statistics.median(statistics.mean(r[GENERATE_TIME].values()) for r in results)
        rewards[name] = [results[0][REWARD][s] for s in sorted(results[0][REWARD])]
        rows.append(
            [
                labels[name],
                f"{step_means[name]:.3f} s",
                f"{generate_means[name]:.3f} s",
                ", ".join(f"{value:.3f}" for value in rewards[name]),
            ]
        )
    body = [
        "## The embedded GRPO recipe",
        "",
        (
            f"`{RECIPE}` (its SFT warm-up, then {steps} RL steps; bf16 sampler) on {ranks} gloo ranks, run with each "
            f"tree's own `train.py`; mean over the RL steps of `{STEP_TIME}` and `{GENERATE_TIME}`, median of {rounds} "
            f"alternating run(s) per variant; `{REWARD}` of each RL step from the first run."
        ),
        "",
        *markdown_table(["generator", "RL step", "generate phase", "reward per step"], rows),
    ]
    if len(step_means) == 2:
        same = sum(a == b for a, b in zip(rewards["before"], rewards["after"]))
        body += [
            "",
            f"- time after / before (below 1: faster): RL step {ratio(step_means['after'], step_means['before'])}, "
            f"generate phase {ratio(generate_means['after'], generate_means['before'])}; RL steps with the same mean "
            f"reward: {same} of {len(rewards['before'])}.",
        ]
    return body
