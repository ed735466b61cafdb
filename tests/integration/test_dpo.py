"""The preference recipe end to end through ``train.py`` (gloo ranks on CPU).

- ``debug_dpo.toml`` on 1 rank and on 4 ranks, two pipeline stages over two data-parallel ranks
  (pairs split over the ranks by compute balancing, several micro-batches), logs the same loss,
  grad norm and ``rewards/*`` for its first steps, and the same held-out evaluation
  (``scripts/loss_compare.py``).
- Resume: a run restarted from its mid-run checkpoint (the reference model and the data position
  in it) logs exactly the uninterrupted run's numbers, evaluations included.
- A dataset row that is no preference pair stops the run naming its file and line.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reference import launch_env
from torchtitan_rl.tensorboard_io import read_scalars

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "train_configs" / "debug_dpo.toml")
STEPS, SAVE_AT = 6, 4
# Small steps (8 pairs) and a small held-out set keep the runs short; the evaluation runs at
# steps 0, 3 and 6.
OPTIONS = (
    "--training.global_batch_size 8 --training.seq_len 64 --training.max_tokens_per_microbatch 96 "
    "--preference.eval_interval 3 "
    "--preference.num_eval_pairs 8 --generation.max_new_tokens 6"
)
TAGS = (
    "loss_metrics/global_avg_loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "eval/loss",
    "eval/rewards/margins",
)


def train(dump: Path, num_ranks: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={num_ranks}",
        str(REPO / "train.py"),
        "--job.config_file",
        RECIPE,
        *OPTIONS.split(),
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)


def test_one_rank_and_pipelined_data_parallel_ranks_log_the_same_steps(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "loss_compare.py"),
            "--config",
            RECIPE,
            "--options",
            OPTIONS,
            "--baseline-ngpu",
            "1",
            "--test-ngpu",
            "4",
            "--test-options",
            "--parallelism.pipeline_parallel_degree 2",
            "--steps",
            "3",
            "--tags",
            ",".join(TAGS),
            "--rtol",
            "1e-4",
            "--atol",
            "1e-6",
            "--output-folder",
            str(tmp_path),
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    scalars = read_scalars(str(tmp_path / "test" / "tb"))
    # Not vacuous: the pairs moved the policy, the held-out evaluation ran, pairs were counted.
    assert min(scalars["grad_norm"].values()) > 0 and sorted(scalars["eval/loss"]) == [0, 3]
    assert scalars["data/num_pairs"][3] == 3 * 8


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    checkpoints = ("--checkpoint.enable", "true", "--checkpoint.interval", str(SAVE_AT))
    whole = tmp_path / "whole"
    run = train(whole, 2, "--training.steps", str(STEPS), *checkpoints)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoint" / f"step-{STEPS}")
    shutil.rmtree(resumed / "tb")
    run = train(resumed, 2, "--training.steps", str(STEPS), *checkpoints)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    assert f"resuming after step {SAVE_AT}" in run.stdout + run.stderr
    want, got = read_scalars(str(whole / "tb")), read_scalars(str(resumed / "tb"))
    for tag in (*TAGS, "rewards/accuracies", "eval/greedy_is_chosen"):
        expected = {step: value for step, value in want[tag].items() if step > SAVE_AT}
        assert expected and got[tag] == expected, tag


def test_a_row_that_is_no_pair_is_named(tmp_path):
    data = tmp_path / "prefs.jsonl"
    rows = [{"prompt": "1 + 1 =", "chosen": "2", "rejected": "3"}] * 20
    rows[7] = {"prompt": "2 + 2 =", "chosen": "4"}
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = train(tmp_path / "run", 1, "--training.dataset_path", str(data), "--training.steps", "3")
    assert run.returncode != 0
    assert f"{data}:8" in run.stderr and "no 'rejected'" in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("loss_fn", ["ipo", "simpo"])
def test_the_other_losses_train(tmp_path, loss_fn):
    run = train(tmp_path, 1, "--loss.loss_fn", loss_fn, "--training.steps", "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    scalars = read_scalars(str(tmp_path / "tb"))
    assert sorted(scalars["rewards/margins"]) == [1, 2] and min(scalars["grad_norm"].values()) > 0
