"""The embedded GRPO recipe, measured: reward curves over several seeds, where a step's time
goes, and the plots in docs/.

    .venv/bin/python scripts/benchmark_grpo.py            # appends to docs/benchmarks.md, writes docs/grpo_*.svg
    .venv/bin/python scripts/benchmark_grpo.py --no-write # print only

Each seed runs ``train_configs/debug_grpo.toml`` on ``--ranks`` gloo ranks (as ``run_train.sh``
does on CPU) for ``--steps`` RL steps. Reported per seed: wall-clock time (SFT warm-up included),
mean reward of the first 5 steps, of steps 26-30 (the window tests/integration/test_grpo.py
checks) and of the last 5, and held-out greedy pass@1 at the end; over all seeds: the share of
an RL step spent in each phase (``time/*_s`` summed over steps, over ``time/step_s`` summed).
"""

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmark_docs import publish  # noqa: E402
from scripts.plot_curves import series, svg_chart  # noqa: E402
from torchtitan_rl.tensorboard_io import read_scalars  # noqa: E402

PHASES = ("weight_sync", "generate", "exchange", "reward", "reference", "old_logprobs", "train", "eval")


def run_seed(seed: int, ranks: int, steps: int, dump: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train.py",
           "--job.config_file", "train_configs/debug_grpo.toml", "--training.steps", str(steps),
           "--debug.seed", str(seed), "--job.dump_folder", dump]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-4000:])
    return time.perf_counter() - start


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="42,1,2")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    rows, phase_sums, step_sum, dumps = [], dict.fromkeys(PHASES, 0.0), 0.0, {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            dump = dumps[seed] = os.path.join(tmp, f"seed{seed}")
            wall = run_seed(seed, args.ranks, args.steps, dump)
            s = read_scalars(os.path.join(dump, "tb"))
            reward = s["rl/reward_mean"]
            rows.append((seed, wall, sum(s["time/step_s"].values()), mean([reward[i] for i in range(1, 6)]),
                         mean([reward[i] for i in range(26, 31)]),
                         mean([reward[i] for i in range(args.steps - 4, args.steps + 1)]),
                         s["eval/pass@1"][args.steps], s["rl/entropy"][args.steps]))
            for phase in PHASES:
                phase_sums[phase] += sum(s.get(f"time/{phase}_s", {}).values())
            step_sum += sum(s["time/step_s"].values())
        curves = {f"seed {seed}": series(dumps[seed], "rl/reward_mean", None) for seed in seeds}
        timed = {f"seed {seed}": series(dumps[seed], "rl/reward_mean", "time/step_s") for seed in seeds}
        charts = {
            "grpo_reward.svg": svg_chart(curves, "debug_grpo: mean reward per RL step (2 CPU ranks)", "RL step",
                                         "rl/reward_mean"),
            "grpo_reward_vs_time.svg": svg_chart(timed, "debug_grpo: mean reward vs RL time (2 CPU ranks)",
                                                 "seconds of RL steps (after the SFT warm-up)", "rl/reward_mean"),
        }

    cmd = " ".join([".venv/bin/python", "scripts/benchmark_grpo.py", *sys.argv[1:]])
    with open(os.path.join(ROOT, "train_configs", "debug_grpo.toml"), "rb") as f:
        warmup = tomllib.load(f)["rl"]["sft_warmup_steps"]
    machine = f"{platform.machine()}, {os.cpu_count()} cores, CPU only"
    lines = [
        f"## GRPO on the embedded recipe, {datetime.date.today().isoformat()} ({machine}, gloo, {args.ranks} ranks)",
        "",
        f"Command: `{cmd}` — `train_configs/debug_grpo.toml` ({args.steps} RL steps after its {warmup}-step SFT "
        "warm-up; 8 arithmetic prompts × 16 completions per step, PPO), one run per seed; `RL steps` is the time "
        "of the RL steps alone.",
        "",
        "| seed | wall-clock | RL steps | reward, steps 1-5 | steps 26-30 | last 5 | held-out greedy pass@1 | entropy |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {seed} | {wall:.0f} s | {rl:.0f} s | {first:.3f} | {mid:.3f} | {last:.3f} | {held_out:.3f} | {ent:.3f} |"
          for seed, wall, rl, first, mid, last, held_out, ent in rows],
        "",
        "Share of RL step time per phase (all seeds): "
        + ", ".join(f"{phase} {phase_sums[phase] / step_sum:.1%}" for phase in PHASES if phase_sums[phase] > 0) + ".",
        "",
        "Plots: [reward per step](grpo_reward.svg), [reward vs time](grpo_reward_vs_time.svg).",
        "",
    ]
    publish(lines, write=not args.no_write)
    if not args.no_write:
        for name, svg in charts.items():
            with open(os.path.join(ROOT, "docs", name), "w") as f:
                f.write(svg)


if __name__ == "__main__":
    main()
