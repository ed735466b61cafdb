"""RL set up without source edits, through ``train.py``: docs/rl.md's task factory
(``tests/unit/rl_plugins/sort_digits.py``, importable from ``PYTHONPATH``) trains as
``rl.task``; ``rl.sft_warmup_only`` warms up, evaluates and saves the warmed-up model as a
Hugging Face export, then exits; a GRPO run starts from that export. The GRPO run's step-0
evaluation (greedy and sampled, on the same held-out problems) equals the warm-up run's
exactly, which only the same weights give, and its reward components are logged."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reference import launch_env
from torchtitan_rl.tensorboard_io import read_scalars

REPO = Path(__file__).resolve().parents[2]
TASK = ("--rl.task", "rl_plugins.sort_digits:make_task", "--rl.num_eval_prompts", "16", "--rl.eval_num_samples", "4")
# Few enough warm-up steps that held-out accuracy is neither 0 nor 1: equal evaluations then
# mean equal weights.
WARMUP_STEPS = 60


def train(dump: Path, *options: str) -> str:
    """``train.py`` in one process with the embedded GRPO recipe, the task factory and ``options``; its output."""
    env = launch_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests" / "unit"), env.get("PYTHONPATH")]))
    command = [sys.executable, "train.py", "--job.config_file", "train_configs/debug_grpo.toml"]
    command += ["--job.dump_folder", str(dump), *TASK, "--rl.num_train_prompts", "0", *options]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run.stdout + run.stderr


@pytest.fixture(scope="module")
def warmed_up(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("warmup")
    log = train(
        dump,
        *("--rl.sft_warmup_only", "true", "--rl.sft_warmup_steps", str(WARMUP_STEPS), "--rl.eval_interval", "1"),
        *("--checkpoint.enable", "true", "--checkpoint.last_save_in_hf", "true"),
    )
    assert f"SFT warm-up: {WARMUP_STEPS} steps" in log and "no RL step runs" in log
    return dump


def test_the_warmup_alone_evaluates_saves_an_export_and_runs_no_rl_step(warmed_up):
    scalars = read_scalars(str(warmed_up / "tb"))
    assert sorted(scalars["sft_warmup/loss"])[-1] == WARMUP_STEPS
    assert sorted(scalars["eval/pass@1"]) == [0] and 0 < scalars["eval/pass@1"][0] < 1, scalars["eval/pass@1"]
    assert not [tag for tag in scalars if tag.startswith("rl/")]
    export = warmed_up / "checkpoint" / "step-0"
    assert sorted(p.name for p in export.iterdir()) == [
        "checkpoint.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_grpo_starts_from_the_export_and_logs_the_reward_components(warmed_up, tmp_path):
    export = warmed_up / "checkpoint" / "step-0"
    log = train(
        tmp_path,
        *("--checkpoint.initial_load_path", str(export), "--checkpoint.initial_load_in_hf", "true"),
        *("--training.steps", "2", "--rl.eval_interval", "2", "--rl.sft_warmup_steps", str(WARMUP_STEPS)),
    )
    assert "SFT warm-up" not in log  # it starts from initial weights
    before, after = read_scalars(str(warmed_up / "tb")), read_scalars(str(tmp_path / "tb"))
    evaluations = sorted(tag for tag in before if tag.startswith("eval/"))
    assert len(evaluations) >= 3
    for tag in evaluations:
        assert after[tag][0] == before[tag][0], tag
    for step in (1, 2):
        components = after["rl/reward_correct"][step] + after["rl/reward_same_digits"][step]
        assert after["rl/reward_mean"][step] == pytest.approx(components, rel=1e-6)
        assert after["rl/pass@1"][step] == pytest.approx(after["rl/reward_correct"][step], rel=1e-6)
