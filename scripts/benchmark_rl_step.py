"""RL step time of the embedded GRPO recipe with the proximal policy taken from the update's own
forward (``rl.proximal = "auto"``) against a separate forward that recomputes it (``"recompute"``,
the behaviour before), and against TRL's GRPOTrainer on the same warmed model and task.

    .venv/bin/python scripts/benchmark_rl_step.py                       # ours only
    .venv/bin/python scripts/benchmark_rl_step.py --trl-python /path/to/venv/bin/python

The recipe's SFT warm-up runs once (``rl.sft_warmup_only``, saved in Hugging Face form); every
run then starts RL from that model on one process: ``--rounds`` paired rounds, alternating the
order of the variants, of ``--steps`` RL steps each. A variant's step time is the median over
rounds of the mean ``time/step_s`` of its steps after the first; the rewards of every step are
listed to show the variants train the same way (same rollouts from the same seed and weights).
With ``--trl-python`` (an interpreter with ``trl`` installed, see ``scripts/trl_grpo_step.py``)
TRL trains the same exported model on the same prompts, one round after each of ours.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import ROOT, add_publish_args, alternating_order, markdown_table, publish, ratio, run_train

RECIPE = "train_configs/debug_grpo.toml"
# name -> (what it runs, its overrides of the recipe)
VARIANTS = {
    "auto": ('`rl.proximal = "auto"`: pi_prox from the update\'s forward', ["--rl.proximal", "auto"]),
    "recompute": ('`rl.proximal = "recompute"`: a separate pi_prox forward', ["--rl.proximal", "recompute"]),
    # TRL samples with the trained model itself (float32, no mismatch, no correction).
    "fp32_sampler": (
        "float32 sampler, no correction (no pi_prox at all)",
        ["--generation.dtype", "float32", "--rl.rollout_correction", "none"],
    ),
}
PHASES = ("generate", "old_logprobs", "train", "weight_sync")


def warm_up(dump: str) -> str:
    """The recipe's SFT warm-up alone, saved as step-0 in Hugging Face form; that folder."""
    run_train(
        [
            "--job.config_file",
            RECIPE,
            "--rl.sft_warmup_only",
            "true",
            "--rl.eval_interval",
            "0",
            "--checkpoint.enable",
            "true",
            "--checkpoint.last_save_in_hf",
            "true",
        ],
        ranks=None,
        dump_folder=dump,
    )
    return os.path.join(dump, "checkpoint", "step-0")


def rl_overrides(model: str, steps: int, *extra: str) -> list[str]:
    """``steps`` RL steps of the recipe from the warmed-up ``model`` (``warm_up``), no evaluation."""
    return [
        "--job.config_file",
        RECIPE,
        "--training.steps",
        str(steps),
        "--rl.eval_interval",
        "0",
        *extra,
        "--checkpoint.initial_load_path",
        model,
        "--checkpoint.initial_load_in_hf",
        "true",
    ]


def run_ours(model: str, variant: str, steps: int) -> dict:
    scalars = run_train(rl_overrides(model, steps, *VARIANTS[variant][1]), ranks=None).scalars
    measured = lambda tag: [scalars[tag][s] for s in sorted(scalars[tag])[1:]] if tag in scalars else []  # noqa: E731
    return {
        "step": statistics.mean(measured("time/step_s")),
        **{phase: statistics.mean(measured(f"time/{phase}_s") or [0.0]) for phase in PHASES},
        "rewards": [scalars["rl/reward_mean"][s] for s in sorted(scalars["rl/reward_mean"])],
    }


def run_trl(python: str, model: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="trl_") as tmp:
        out = os.path.join(tmp, "trl.json")
        cmd = [python, "scripts/trl_grpo_step.py", "--model", model, "--steps", str(steps), "--json", out]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError("TRL run failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]))
        with open(out) as f:
            result = json.load(f)
    return {"step": statistics.mean(result["step_seconds"][1:]), "rewards": result["reward_mean"], "raw": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trl-python", help="an interpreter with trl installed: also time TRL's GRPOTrainer")
    add_publish_args(parser, "rl_step")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="rl_step_") as tmp:
        model = warm_up(tmp)
        assert glob.glob(os.path.join(model, "*.safetensors")), f"no Hugging Face export in {model}"
        runs: dict[str, list[dict]] = {name: [] for name in [*VARIANTS, *(["trl"] if args.trl_python else [])]}
        for order in alternating_order(list(runs), args.rounds):
            for name in order:
                if name == "trl":
                    runs[name].append(run_trl(args.trl_python, model, args.steps))
                else:
                    runs[name].append(run_ours(model, name, args.steps))
                print(f"{name}: {runs[name][-1]['step']:.3f} s per step", file=sys.stderr, flush=True)

    step = {name: statistics.median(r["step"] for r in results) for name, results in runs.items()}
    rows = []
    for name, (label, _) in VARIANTS.items():
        phases = {phase: statistics.median(r[phase] for r in runs[name]) for phase in PHASES}
        rows.append(
            [
                label,
                f"{step[name]:.3f} s",
                *(f"{phases[phase]:.3f} s" for phase in PHASES),
                ", ".join(f"{v:.3f}" for v in runs[name][0]["rewards"]),
            ]
        )
    body = [
        f"`{RECIPE}` (as shipped: bf16 sampler, TIS), warmed up once, then {args.steps} RL steps per run on one "
        f"process; {args.rounds} paired rounds; times are medians over rounds of the mean of steps 2..{args.steps}.",
        "",
        *markdown_table(["run", "RL step", *(f"{phase}" for phase in PHASES), "reward per step (first round)"], rows),
        "",
        f"Fused / separate step time as shipped: **{ratio(step['auto'], step['recompute'])}** (the same rewards: "
        "the same rollouts and updates).",
    ]
    if "trl" in runs:
        trl = runs["trl"][0]["raw"]
        # Paths of this run's temporary files say nothing about the settings.
        settings = {key: value for key, value in trl.get("settings", {}).items() if key not in ("model", "config")}
        body += [
            "",
            "## Against TRL's GRPOTrainer",
            "",
            f"TRL {trl.get('trl_version', '?')} on the same exported model and prompts "
            f"(`scripts/trl_grpo_step.py`; settings: `{json.dumps(settings)}`), "
            f"one process, median over rounds of the mean step after the first: {step['trl']:.3f} s.",
            "",
            *markdown_table(
                ["run", "RL step", "/ TRL's"],
                [
                    [label, f"{step[name]:.3f} s", ratio(step[name], step["trl"])]
                    for name, label in [*((n, v[0]) for n, v in VARIANTS.items()), ("trl", "TRL GRPOTrainer")]
                ],
            ),
        ]
    publish(
        args,
        "RL step: the proximal policy from the update's own forward",
        "RL step time of the embedded GRPO recipe with pi_prox from the update's forward vs a separate "
        "recomputing forward, and against TRL's GRPOTrainer.",
        body,
    )


if __name__ == "__main__":
    main()
