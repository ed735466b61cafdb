"""What the rollout dump costs: RL step time of the embedded GRPO recipe with the dump and the
TensorBoard table on (the defaults) against both off, the files' size, and the training path's
share of the work at a larger scale.

    .venv/bin/python scripts/benchmark_rollout_dump.py

The recipe's SFT warm-up runs once; every run then starts RL from that model: ``--rounds`` paired
rounds of ``--steps`` RL steps on ``--ranks`` processes, alternating the order of the variants. A
variant's step time is the median over rounds of the mean ``time/step_s`` of its steps after the
first. The scale table times, for synthetic steps of many long rollouts, what the training
thread does (the rank's share as one batch, ``sample_batch``, pickled as ``gather_object``
does) against what rank 0's writer thread does (the records, decoding, JSON, gzip).
"""

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time

import torch

from bench_common import add_publish_args, alternating_order, markdown_table, publish, ratio, run_train
from benchmark_rl_step import RECIPE, rl_overrides, warm_up
from torchtitan_rl import rollout_files
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.rl.generator import Rollout
from torchtitan_rl.rl.rollout_dump import batch_records, decode_rollout, sample_batch
from torchtitan_rl.rl.rollouts import ScoredGroup, to_samples
from torchtitan_rl.rl.tasks import Reward

VARIANTS = {
    "on": ("dump + 4 TensorBoard rows (defaults)", []),
    "off": (
        "off (`rl.dump_rollouts = false`, `rl.log_samples = 0`)",
        ["--rl.dump_rollouts", "false", "--rl.log_samples", "0"],
    ),
}


def run_variant(model: str, variant: str, steps: int, ranks: int, dump: str) -> dict:
    scalars = run_train(rl_overrides(model, steps, *VARIANTS[variant][1]), ranks=ranks, dump_folder=dump).scalars
    timed = sorted(scalars["time/step_s"])[1:]
    files = [rollout_files.step_file(os.path.join(dump, rollout_files.ROLLOUTS), s) for s in range(1, steps + 1)]
    sizes = [os.path.getsize(f) for f in files if os.path.exists(f)]
    return {
        "step": statistics.mean(scalars["time/step_s"][s] for s in timed),
        "log": statistics.mean(scalars["time/rollout_log_s"][s] for s in timed),
        "bytes": statistics.mean(sizes) if sizes else 0.0,
        "rollouts": scalars["rl/num_rollouts"][timed[0]],
        "completion_tokens": scalars["rl/response_length_mean"][timed[0]] * scalars["rl/num_rollouts"][timed[0]],
    }


def synthetic_step(num_rollouts: int, prompt_len: int, completion_len: int) -> list:
    """Samples of ``num_rollouts`` random byte-token rollouts, groups of 16."""
    generator = torch.Generator().manual_seed(0)
    groups = []
    for g in range(num_rollouts // 16):
        rollouts = [
            Rollout(
                g,
                s,
                torch.randint(32, 127, (prompt_len,), generator=generator).tolist(),
                torch.randint(32, 127, (completion_len,), generator=generator).tolist(),
                (-torch.rand(completion_len, generator=generator)).tolist(),
                "length",
            )
            for s in range(16)
        ]
        groups.append(ScoredGroup(g, rollouts, [Reward(0.5, False, {"correct": 0.0})] * 16, [0.0] * 16))
    return to_samples(groups, prompt_len + completion_len)


def time_scale(num_rollouts: int, prompt_len: int, completion_len: int) -> list:
    samples = synthetic_step(num_rollouts, prompt_len, completion_len)
    tokenizer = build_tokenizer("")
    start = time.perf_counter()
    batch = sample_batch(samples, step=1)
    payload = pickle.dumps(batch)
    training = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="dump_scale_") as tmp:
        start = time.perf_counter()
        records = (decode_rollout(tokenizer, r) for r in batch_records([pickle.loads(payload)]))
        path = rollout_files.write_step(tmp, 1, records)
        writer = time.perf_counter() - start
        size = os.path.getsize(path)
    return [
        f"{num_rollouts} × ({prompt_len} + {completion_len})",
        f"{training:.3f} s",
        f"{len(payload) / 2**20:.1f} MiB",
        f"{writer:.2f} s",
        f"{size / 2**20:.2f} MiB",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    add_publish_args(parser, "rollout_dump")
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="rollout_dump_") as tmp:
        model = warm_up(os.path.join(tmp, "warmup"))
        for round_index, order in enumerate(alternating_order(list(VARIANTS), args.rounds)):
            for name in order:
                dump = os.path.join(tmp, f"{name}_{round_index}")
                runs[name].append(run_variant(model, name, args.steps, args.ranks, dump))
                print(f"{name}: {runs[name][-1]['step']:.3f} s per step", file=sys.stderr, flush=True)

    step = {name: statistics.median(r["step"] for r in results) for name, results in runs.items()}
    log = {name: statistics.median(r["log"] for r in results) for name, results in runs.items()}
    on = runs["on"][0]
    rows = [
        [
            label,
            f"{step[name]:.3f} s",
            f"{min(r['step'] for r in runs[name]):.3f} – {max(r['step'] for r in runs[name]):.3f} s",
            f"{log[name] * 1e3:.1f} ms",
        ]
        for name, (label, _) in VARIANTS.items()
    ]
    scale = [time_scale(*shape) for shape in ((128, 64, 256), (512, 256, 2048))]
    body = [
        f"`{RECIPE}` (as shipped), warmed up once, then {args.steps} RL steps per run on {args.ranks} rank(s); "
        f"{args.rounds} paired rounds; times are medians over rounds of the mean of steps 2..{args.steps}. "
        "`time/rollout_log_s` is what the training thread spends on the records (building, gathering, "
        "the table rows); the writer thread's decoding and gzip run beside the next step.",
        "",
        *markdown_table(["run", "RL step", "runs' range", "time/rollout_log_s"], rows),
        "",
        f"Step time on / off: **{ratio(step['on'], step['off'], 3)}** (goal: at most 1.02); compare it with the "
        "range of one variant's runs, the machine's noise. The training thread's part, `time/rollout_log_s`, "
        f"is {100 * log['on'] / step['off']:.1f} % of the step; the writer thread's work is timed in the table "
        "below.",
        "",
        f"Size: {on['bytes'] / 1024:.1f} KiB per step for {on['rollouts']:.0f} rollouts of "
        f"{on['completion_tokens'] / on['rollouts']:.1f} completion tokens on average "
        f"({on['bytes'] / on['rollouts']:.0f} bytes per rollout, prompt text included).",
        "",
        "## At a larger scale",
        "",
        "Synthetic steps of random printable bytes (incompressible compared with real text), one process: the "
        "training thread's part (the rank's share as one batch, `sample_batch`, and its pickle, which "
        "`gather_object` sends to rank 0) against the writer thread's (the records, decoding, JSON, gzip).",
        "",
        *markdown_table(
            ["rollouts × (prompt + completion tokens)", "training thread", "pickled", "writer thread", "file"],
            scale,
        ),
    ]
    publish(
        args,
        "Rollout dump: cost and size",
        "RL step time with every rollout dumped and a TensorBoard sample table against neither, and the files' size.",
        body,
    )


if __name__ == "__main__":
    main()
