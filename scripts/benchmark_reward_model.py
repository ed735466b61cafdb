"""The embedded reward-model recipe, measured: held-out pair accuracy over several seeds, and
which arithmetic the trained model judges.

    .venv/bin/python scripts/benchmark_reward_model.py             # rewrites docs/benchmarks/reward_model.md
    .venv/bin/python scripts/benchmark_reward_model.py --no-write  # print only

Each seed runs ``train_configs/debug_rm.toml`` (a Bradley–Terry reward model of the tiny Qwen3
on arithmetic pairs whose chosen answer is right and whose rejected one a near miss, evaluated
on 128 held-out pairs every ``preference.eval_interval`` steps) on ``--ranks`` gloo ranks, as
shipped. Reported per seed: wall-clock time (start-up and the final export included) and the
held-out ``eval/rm/accuracy`` and ``eval/loss`` at every evaluation. Then the run's Hugging Face
export, loaded by ``transformers`` as ``Qwen3ForSequenceClassification``, scores
``--num-probe-pairs`` pairs drawn from another seed of the same generator, and the pair accuracy
is reported per operation and per kind of near miss (off in the last digit, or by exactly 10).
"""

import argparse
import os
import tempfile

from bench_common import add_publish_args, markdown_table, publish, run_train

RECIPE = "train_configs/debug_rm.toml"
PROBE_SEED = 12345
OPERATIONS = ("+", "-", "*")


def probe_accuracies(export: str, num_pairs: int) -> dict[str, tuple[int, float]]:
    """``{group: (pairs, accuracy)}`` of the exported reward model on fresh pairs, grouped by
    operation and by whether the near miss differs in the last digit or by a multiple of 10."""
    import torch
    from transformers import Qwen3ForSequenceClassification

    from torchtitan_rl.data.preferences import tokenize_preference_row
    from torchtitan_rl.data.tasks import arithmetic_preferences
    from torchtitan_rl.data.tokenizer import build_tokenizer

    model = Qwen3ForSequenceClassification.from_pretrained(export).eval()
    tokenizer = build_tokenizer("")
    right: dict[str, list[bool]] = {}
    with torch.no_grad():
        for row in arithmetic_preferences(num_pairs, PROBE_SEED):
            chosen, rejected = (
                model(input_ids=torch.tensor(side.tokens)[None]).logits[0, 0]
                for side in tokenize_preference_row(row, tokenizer, ".")
            )
            operation = row["prompt"][0]["content"].split()[3]
            miss = "last digit" if (int(row["chosen"]) - int(row["rejected"])) % 10 else "by 10"
            for group in ("all", operation, f"{operation}, {miss}"):
                right.setdefault(group, []).append(bool(chosen > rejected))
    return {group: (len(v), sum(v) / len(v)) for group, v in right.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--num-probe-pairs", type=int, default=600)
    add_publish_args(parser, "reward_model")
    args = parser.parse_args()
    runs, probes = {}, {}
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory(prefix="bench_rm_") as dump:
            runs[seed] = run_train(
                ["--job.config_file", RECIPE, "--debug.seed", str(seed)], ranks=args.ranks, dump_folder=dump
            )
            checkpoints = os.path.join(dump, "checkpoint")
            last = max(os.listdir(checkpoints), key=lambda name: int(name.split("-")[1]))
            probes[seed] = probe_accuracies(os.path.join(checkpoints, last), args.num_probe_pairs)
    steps = sorted(next(iter(runs.values())).series("eval/rm/accuracy"))
    rows = [
        [seed, f"{run.wall_s:.0f} s"]
        + [f"{run.series('eval/rm/accuracy')[step]:.3f}" for step in steps]
        + [f"{run.series('eval/loss')[steps[0]]:.3f} → {run.series('eval/loss')[steps[-1]]:.3f}"]
        for seed, run in runs.items()
    ]
    groups = [g for g in next(iter(probes.values())) if g == "all" or g in OPERATIONS] + sorted(
        g for g in next(iter(probes.values())) if "," in g
    )
    probe_rows = [
        [group, next(iter(probes.values()))[group][0], *(f"{probes[seed][group][1]:.3f}" for seed in probes)]
        for group in groups
    ]
    body = [
        f"`{RECIPE}` as shipped on {args.ranks} rank(s), from scratch; `eval/rm/accuracy` (share of the 128 "
        "held-out pairs whose chosen completion scores higher) at each evaluation step.",
        "",
        *markdown_table(["seed", "wall", *(f"step {step}" for step in steps), "eval/loss"], rows),
        "",
        f"Pair accuracy of each run's final export (`transformers`' `Qwen3ForSequenceClassification`) on "
        f"{args.num_probe_pairs} pairs of another seed ({PROBE_SEED}), by operation and by the kind of near miss.",
        "",
        *markdown_table(["pairs", "count", *(f"seed {seed}" for seed in probes)], probe_rows),
    ]
    publish(
        args,
        "Reward model: the embedded recipe",
        "Held-out pair accuracy of debug_rm.toml at every evaluation, over seeds, its wall-clock time, "
        "and its accuracy per arithmetic operation.",
        body,
    )


if __name__ == "__main__":
    main()
