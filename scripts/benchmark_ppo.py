"""PPO with a learned critic against GRPO, measured: reward against samples generated at the same
number of completions per step, over several seeds, and what the critic costs per step.

    .venv/bin/python scripts/benchmark_ppo.py            # rewrites its page and figure in docs/benchmarks/
    .venv/bin/python scripts/benchmark_ppo.py --no-write # print only

Per seed, one SFT warm-up (``debug_grpo.toml``'s, ``rl.sft_warmup_only``) starts three runs of
``--steps`` RL steps on ``--ranks`` gloo ranks, each generating 128 completions per step of the
same 8-prompt pool:

- GRPO, group 16: ``debug_grpo.toml`` (8 prompts × 16, group baseline);
- PPO, group 4: ``debug_ppo.toml`` (32 prompts × 4, the critic's baseline);
- PPO, group 1: ``debug_ppo.toml`` with 128 prompts × 1.

Reported per variant, as the mean over seeds: the mean reward of the first and last 5 steps and
held-out greedy pass@1 at the end; and the seconds of an RL step (the mean over steps and seeds)
with the critic's share (its value pass, ``time/critic_values_s``; its update is inside
``time/train_s``, so the step time's ratio to GRPO's is the overhead). The figure draws each
variant's reward, averaged over seeds, against the completions generated.
"""

import argparse
import os
import tempfile

from bench_common import add_publish_args, markdown_table, publish, run_train
from plot_runs import svg_figure

GRPO_RECIPE, PPO_RECIPE = "train_configs/debug_grpo.toml", "train_configs/debug_ppo.toml"
SAMPLES_PER_STEP = 128
# name: (recipe, overrides); every variant generates SAMPLES_PER_STEP completions per step.
VARIANTS = {
    "GRPO, group 16": (GRPO_RECIPE, []),
    "PPO, group 4": (PPO_RECIPE, []),
    "PPO, group 1": (PPO_RECIPE, ["--rl.group_size", "1", "--rl.prompts_per_step", str(SAMPLES_PER_STEP)]),
}
REWARD, GENERATED = "rl/reward_mean", "rollouts/generated"
FIGURE = "ppo_reward.svg"


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def warmed_up(seed: int, ranks: int, folder: str) -> str:
    """The SFT warm-up of ``seed`` as a model-only checkpoint; its path."""
    run_train(
        [
            *("--job.config_file", GRPO_RECIPE, "--debug.seed", str(seed)),
            *("--rl.sft_warmup_only", "true", "--checkpoint.enable", "true", "--rl.eval_interval", "0"),
        ],
        ranks=ranks,
        dump_folder=folder,
    )
    return os.path.join(folder, "checkpoint", "step-0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    add_publish_args(parser, "ppo")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.steps < 10:
        parser.error("--steps must be >= 10: the table compares the first and last 5 steps")

    runs = {name: [] for name in VARIANTS}  # name -> each seed's scalars
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="bench_ppo_") as tmp:
            start = warmed_up(seed, args.ranks, os.path.join(tmp, "warmup"))
            for name, (recipe, overrides) in VARIANTS.items():
                run = run_train(
                    [
                        *("--job.config_file", recipe, "--debug.seed", str(seed)),
                        *("--training.steps", str(args.steps), "--rl.sft_warmup_steps", "0"),
                        *("--checkpoint.initial_load_path", start),
                        *overrides,
                    ],
                    ranks=args.ranks,
                )
                runs[name].append(run.scalars)
                print(f"seed {seed} {name}: reward {run.first_last(REWARD)}", flush=True)

    rows, curves = [], {}
    grpo_step_s = mean(mean(s["time/step_s"].values()) for s in runs["GRPO, group 16"])
    last = range(args.steps - 4, args.steps + 1)
    for name, scalars in runs.items():
        step_s = mean(mean(s["time/step_s"].values()) for s in scalars)
        critic_s = mean(mean(s.get("time/critic_values_s", {0: 0.0}).values()) for s in scalars)
        rows.append(
            [
                name,
                f"{mean(mean(s[REWARD][i] for i in range(1, 6)) for s in scalars):.3f}",
                f"{mean(mean(s[REWARD][i] for i in last) for s in scalars):.3f}",
                " / ".join(f"{mean(s[REWARD][i] for i in last):.2f}" for s in scalars),
                f"{mean(s['eval/pass@1'][args.steps] for s in scalars):.3f}",
                f"{step_s:.2f} s",
                f"{step_s / grpo_step_s:.2f}",
                f"{critic_s / step_s:.1%}",
            ]
        )
        steps = sorted(scalars[0][REWARD])
        curves[name] = {
            REWARD: {step: mean(s[REWARD][step] for s in scalars) for step in steps},
            GENERATED: dict.fromkeys(steps, float(SAMPLES_PER_STEP)),
        }

    body = [
        (
            f"{args.steps} RL steps per run after one SFT warm-up per seed (`{GRPO_RECIPE}`'s 500 steps, shared by "
            f"the three variants), {SAMPLES_PER_STEP} completions per step of the same 8 arithmetic prompts, on "
            f"{args.ranks} gloo ranks; seeds {', '.join(map(str, seeds))}. Rewards and pass@1 are means over the "
            "seeds (the last-5 column also per seed); step seconds are means over steps and seeds."
        ),
        "",
        *markdown_table(
            [
                "variant",
                "reward, steps 1-5",
                "last 5",
                "last 5 per seed",
                "held-out greedy pass@1",
                "RL step",
                "vs GRPO",
                "critic values share",
            ],
            rows,
        ),
        "",
        f"Figure: [reward against completions generated]({FIGURE}) (each variant's mean over the seeds).",
    ]
    publish(
        args,
        "PPO with a learned critic vs GRPO",
        "Reward against samples generated for PPO with a critic at group sizes 1 and 4 and GRPO at "
        "16, the same completions per step, over several seeds; the critic's cost per step.",
        body,
    )
    if not args.no_write:
        title = f"mean reward over seeds {', '.join(map(str, seeds))} vs completions generated ({args.ranks} ranks)"
        with open(os.path.join(os.path.dirname(os.path.abspath(args.page)), FIGURE), "w", encoding="utf-8") as f:
            f.write(svg_figure(curves, [REWARD], x_tag=GENERATED, title=title))


if __name__ == "__main__":
    main()
