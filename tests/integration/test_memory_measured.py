"""The memory estimate against measured memory: whole runs (model build, data, two optimizer
steps) under ``scripts/measure_memory.py``, which records the peak of live torch CPU tensors of
each rank; the estimate's peak must be within 15 % of it, and the AdamW moments the first
optimizer step creates (twice the rank's trainable shard) within 3 % of their estimate.

The SFT runs read text rows longer than ``training.seq_len``, so that every sample is
``seq_len`` tokens long as the estimate assumes (short samples pack fewer tokens into a
micro-batch than its budget). The CPU trains in float32."""

import sys
from pathlib import Path

import pytest

from torchtitan_rl.config import ConfigManager
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.estimate.memory import estimate_memory
from torchtitan_rl.recipes.base import lora_settings
from torchtitan_rl.recipes.estimate import estimate_model_args

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from measure_memory import measure, write_long_rows  # noqa: E402

SFT = ["--job.config_file", str(REPO / "train_configs/debug_model.toml")]
GRPO = ["--job.config_file", str(REPO / "train_configs/debug_grpo.toml"), "--rl.sft_warmup_steps", "0"]
# name -> (ranks, arguments); the SFT ones also read the long rows.
CASES = {
    "one_rank": (1, SFT),
    "dp2_full_checkpointing": (2, [*SFT, "--activation_checkpoint.mode", "full"]),
    "tp2_lora": (2, [*SFT, "--parallelism.tensor_parallel_degree", "2", "--lora.enable", "true"]),
    "cp2_moe_model": (2, [*SFT, "--parallelism.context_parallel_degree", "2", "--model.flavor", "debugmodel_moe"]),
    "grpo": (1, [*GRPO, "--rl.eval_interval", "0"]),
}


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory) -> str:
    return write_long_rows(str(tmp_path_factory.mktemp("memory") / "long.jsonl"))


@pytest.mark.parametrize("case", CASES)
def test_estimated_peak_is_within_15_percent_of_the_measured_one(case, long_rows, tmp_path):
    num_ranks, argv = CASES[case]
    argv = [*argv, "--training.steps", "2", "--metrics.enable_tensorboard", "false"]
    if argv[:2] == SFT:
        argv += ["--training.dataset_path", long_rows]
    ranks = measure([*argv, "--job.dump_folder", str(tmp_path / "run")], num_ranks, str(tmp_path / "measured"))
    assert all(r["exit_status"] == 0 for r in ranks)

    config = ConfigManager().parse_args(argv)
    dims = ParallelDims.from_config(config.parallelism, num_ranks)
    (estimate,) = estimate_memory(config, estimate_model_args(config), dims, lora_settings(config), "float32")
    measured = max(r["peak_bytes"] for r in ranks)
    assert estimate.peak == pytest.approx(measured, rel=0.15), estimate.items
    # AdamW creates its moments in the first step: what that step adds is the rank's trainable shard.
    for rank in ranks:
        first = rank["optimizer_steps"][0]
        added = first["live_bytes_at_end"] - first["live_bytes_at_start"]
        assert estimate.item("optimizer") == pytest.approx(added, rel=0.03), rank["rank"]
