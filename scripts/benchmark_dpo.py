"""The embedded preference recipe, measured: held-out preference accuracy and greedy pass@1 over
several seeds, with and without the NLL term on the chosen answers.

    .venv/bin/python scripts/benchmark_dpo.py             # rewrites docs/benchmarks/dpo.md
    .venv/bin/python scripts/benchmark_dpo.py --no-write  # print only

Each seed runs ``train_configs/debug_dpo.toml`` (DPO from scratch on arithmetic pairs whose
chosen answer is right and whose rejected one a near miss, evaluated on 128 held-out pairs every
100 steps) on ``--ranks`` gloo ranks, as shipped (``loss.nll_coef = 1``) and with
``loss.nll_coef = 0`` (plain DPO). Reported per run: wall-clock time, the held-out
``eval/rewards/accuracies`` and ``eval/greedy_is_chosen`` (greedy pass@1: the chosen answers are
the right ones) at step 0 and at the end, and the held-out loss.
"""

import argparse

from bench_common import add_publish_args, markdown_table, publish, run_train

RECIPE = "train_configs/debug_dpo.toml"
VARIANTS = {"as shipped (`loss.nll_coef = 1`)": [], "plain DPO (`loss.nll_coef = 0`)": ["--loss.nll_coef", "0"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    add_publish_args(parser, "dpo")
    args = parser.parse_args()
    rows = []
    for name, extra in VARIANTS.items():
        for seed in (int(s) for s in args.seeds.split(",")):
            run = run_train(["--job.config_file", RECIPE, "--debug.seed", str(seed), *extra], ranks=args.ranks)
            s = run.scalars
            last = max(s["eval/loss"])
            rows.append(
                [
                    name,
                    seed,
                    f"{run.wall_s:.0f} s",
                    f"{s['eval/rewards/accuracies'][0]:.3f} → {s['eval/rewards/accuracies'][last]:.3f}",
                    f"{s['eval/greedy_is_chosen'][0]:.3f} → {s['eval/greedy_is_chosen'][last]:.3f}",
                    f"{s['eval/loss'][0]:.3f} → {s['eval/loss'][last]:.3f}",
                ]
            )
    body = [
        f"`{RECIPE}` on {args.ranks} rank(s), from scratch; 128 held-out pairs, evaluated at step 0 and at the "
        "end. At step 0 the policy is its own reference: every implicit reward is 0, so no pair counts as "
        "preferred (accuracy 0) and the loss is log 2.",
        "",
        *markdown_table(
            ["run", "seed", "wall", "eval/rewards/accuracies", "eval/greedy_is_chosen (pass@1)", "eval/loss"], rows
        ),
    ]
    publish(
        args,
        "DPO: the embedded preference recipe",
        "Held-out preference accuracy and greedy pass@1 of debug_dpo.toml over seeds, with and without the "
        "NLL term on the chosen answers.",
        body,
    )


if __name__ == "__main__":
    main()
