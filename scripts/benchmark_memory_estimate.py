"""The memory estimator (``train.py --estimate``) against measured memory on the CPU.

Every case is a whole ``train.py`` run of two optimizer steps under ``measure_memory.py`` (the
peak of live torch CPU tensors per rank, every thread counted); its estimate is computed from
the same arguments in float32, the CPU's compute dtype. SFT runs read text rows longer than
``training.seq_len`` (every sample exactly ``seq_len`` tokens, as the estimate assumes).

    python scripts/benchmark_memory_estimate.py             # every case, the 0.6B model included
    python scripts/benchmark_memory_estimate.py --quick     # without the 0.6B model (~2 min)
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_common, measure_memory

from bench_common import ROOT, add_publish_args, markdown_table, publish  # noqa: E402
from measure_memory import measure, write_long_rows  # noqa: E402
from torchtitan_rl.config import ConfigManager  # noqa: E402
from torchtitan_rl.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan_rl.estimate.memory import estimate_memory  # noqa: E402
from torchtitan_rl.recipes.base import lora_settings  # noqa: E402
from torchtitan_rl.recipes.estimate import estimate_model_args  # noqa: E402

MIB = 2**20
SFT = ["--job.config_file", os.path.join(ROOT, "train_configs/debug_model.toml")]
PP = ["--job.config_file", os.path.join(ROOT, "train_configs/debug_pp.toml")]
GRPO = ["--job.config_file", os.path.join(ROOT, "train_configs/debug_grpo.toml"), "--rl.sft_warmup_steps", "0"]
# name -> (ranks, arguments, reads the long rows)
CASES = {
    "debug model, 1 rank": (1, SFT, True),
    "1 rank, 1024-token micro-batches": (1, [*SFT, "--training.max_tokens_per_microbatch", "1024"], True),
    "1 rank, full checkpointing": (1, [*SFT, "--activation_checkpoint.mode", "full"], True),
    "1 rank, selective checkpointing": (1, [*SFT, "--activation_checkpoint.mode", "selective"], True),
    "1 rank, LoRA": (1, [*SFT, "--lora.enable", "true"], True),
    "dp2 (FSDP)": (2, SFT, True),
    "dp2, full checkpointing": (2, [*SFT, "--activation_checkpoint.mode", "full"], True),
    "HSDP 2 replicas": (2, [*SFT, "--parallelism.data_parallel_replicate_degree", "2"], True),
    "tp2": (2, [*SFT, "--parallelism.tensor_parallel_degree", "2"], True),
    "tp2, LoRA": (2, [*SFT, "--parallelism.tensor_parallel_degree", "2", "--lora.enable", "true"], True),
    "cp2": (2, [*SFT, "--parallelism.context_parallel_degree", "2"], True),
    "pp2 (1F1B)": (2, PP, True),
    "MoE debug model, 1 rank": (1, [*SFT, "--model.flavor", "debugmodel_moe"], True),
    "MoE debug model, ep2": (
        2,
        [*SFT, "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2"],
        True,
    ),
    "GRPO step, 1 rank": (1, [*GRPO, "--rl.eval_interval", "0"], False),
    "GRPO step, dp2": (2, [*GRPO, "--rl.eval_interval", "0"], False),
}
# A model of real width: its two steps take minutes on 2 cores.
WIDE = {
    "Qwen3-0.6B, 1 rank, 256-token micro-batches": (
        1,
        [
            *SFT,
            "--model.flavor",
            "0.6B",
            "--training.global_batch_size",
            "4",
            "--training.max_tokens_per_microbatch",
            "256",
        ],
        True,
    )
}


def run_case(name: str, ranks: int, argv: list[str], long_rows: str | None, folder: str) -> list:
    argv = [*argv, "--training.steps", "2", "--metrics.enable_tensorboard", "false"]
    if long_rows:
        argv += ["--training.dataset_path", long_rows]
    slug = "".join(c if c.isalnum() else "_" for c in name)
    measured = measure(
        [*argv, "--job.dump_folder", os.path.join(folder, slug)], ranks, os.path.join(folder, slug + "_m")
    )
    config = ConfigManager().parse_args(argv)
    dims = ParallelDims.from_config(config.parallelism, ranks)
    estimates = estimate_memory(config, estimate_model_args(config), dims, lora_settings(config), "float32")
    peak = max(r["peak_bytes"] for r in measured)
    estimate = max(estimates, key=lambda e: e.peak)
    first = measured[0]["optimizer_steps"][0]
    moments = first["live_bytes_at_end"] - first["live_bytes_at_start"]
    return [
        name,
        ranks,
        f"{peak / MIB:.2f}",
        f"{estimate.peak / MIB:.2f}",
        f"{estimate.peak / peak:.3f}",
        estimate.peak_phase,
        f"{estimates[0].item('optimizer') / moments:.3f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="leave out the 0.6B model")
    add_publish_args(parser, "memory_estimate")
    args = parser.parse_args()
    cases = CASES if args.quick else {**CASES, **WIDE}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        long_rows = write_long_rows(os.path.join(folder, "long.jsonl"))
        for name, (ranks, argv, long) in cases.items():
            rows.append(run_case(name, ranks, argv, long_rows if long else None, folder))
            print(" | ".join(str(v) for v in rows[-1]), flush=True)
    ratios = [float(r[4]) for r in rows]
    summary = (
        f"Estimated peak memory per rank over measured, {len(rows)} CPU runs (1-2 ranks: DP, HSDP, TP, CP, PP, EP, "
        f"LoRA, checkpointing, MoE, GRPO): {min(ratios):.2f}-{max(ratios):.2f}."
    )
    body = [
        "Measured: the peak of live torch CPU tensors of each rank over the whole run (model build, data, "
        "two optimizer steps), every thread counted (`scripts/measure_memory.py`); the table shows the "
        "busiest rank. Estimated: `train.py --estimate` from the same arguments, float32. `moments`: AdamW's "
        "moments estimated over what the first optimizer step allocated (a check of the trainable shard "
        "under each layout).",
        "",
        *markdown_table(
            ["case", "ranks", "measured MiB", "estimated MiB", "estimated / measured", "peak phase", "moments"], rows
        ),
    ]
    publish(args, "Memory estimate against measured memory", summary, body)


if __name__ == "__main__":
    main()
