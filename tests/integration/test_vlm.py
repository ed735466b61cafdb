"""The VLM recipe end to end: ``train.py`` with ``train_configs/vlm_shapes.toml`` on 2 gloo ranks
learns the colours of the built-in ``shapes`` task, judged on fresh images by
``scripts/eval_vlm_shapes.py`` from the run's Hugging Face export.

Calibration (docs/benchmarks/vlm.md): after the recipe's 120 steps, colour accuracy on 60 held-out
questions was 0.98, 0.72, 0.58 and 0.50 for seeds 42 (the recipe's), 1, 2 and 3, against a
chance of 1/6; after 60 steps 0.23-0.50. The bar below, 0.4 (24 of 60 right), is more than
twice chance, which guessing reaches with probability below 1e-4.
"""

import json
import subprocess
import sys
from pathlib import Path

import tokenizers

from reference import launch_env
from torchtitan_rl import rollout_files
from torchtitan_rl.tensorboard_io import read_scalars
from unit.test_tokenizer import QWEN_SPECIAL_TOKENS, make_hf_tokenizer_dir

REPO = Path(__file__).resolve().parents[2]
STEPS = 120
MIN_ACCURACY = 0.4


def train_on_two_ranks(recipe: str, dump: Path, *options: str) -> str:
    """``train.py`` with ``train_configs/RECIPE`` and ``options`` under torchrun on 2 ranks; its output."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            "--job.config_file",
            f"train_configs/{recipe}",
            "--job.dump_folder",
            str(dump),
            *options,
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run.stdout + run.stderr


def test_vlm_shapes_recipe_learns_colours_on_two_ranks(tmp_path):
    train_on_two_ranks(
        "vlm_shapes.toml",
        tmp_path,
        "--training.steps",
        str(STEPS),
        "--checkpoint.enable",
        "true",
        "--checkpoint.last_save_model_only",
        "true",
        "--checkpoint.last_save_in_hf",
        "true",
        "--metrics.log_freq",
        "10",
    )
    scalars = read_scalars(str(tmp_path / "tb"))
    loss = scalars["loss_metrics/global_avg_loss"]
    assert loss[STEPS] < 0.25 * loss[1], loss
    # The shapes rows carry images: the vision counters are logged with the data counters.
    assert scalars["data/num_images"][STEPS] > STEPS
    # The split trained is the balanced one (training.balance_dp_compute's default), and on rows
    # of random image sizes it is more even than the contiguous split: measured over the 13
    # logged steps, at most 1.014 (mean 1.006) against a mean of 1.056 for the contiguous split.
    used, balanced, contiguous = (
        scalars[f"data/dp_cost_imbalance{split}"] for split in ("", "_balanced", "_contiguous")
    )
    assert used == balanced and len(used) == STEPS // 10 + 1, used
    assert max(balanced.values()) < 1.05, balanced
    assert sum(contiguous.values()) - sum(balanced.values()) > 0.02 * len(balanced), (balanced, contiguous)
    evaluation = subprocess.run(
        [
            sys.executable,
            "scripts/eval_vlm_shapes.py",
            str(tmp_path / "checkpoint" / f"step-{STEPS}"),
            "--questions",
            "60",
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert evaluation.returncode == 0, evaluation.stderr[-4000:]
    result = json.loads(evaluation.stdout.strip().splitlines()[-1])
    assert result["chance"] == 1 / 6
    assert result["colour_accuracy"] >= MIN_ACCURACY, result


def test_a_qwen_tokenizer_without_pixtral_tokens_trains_the_vlm_unedited(tmp_path):
    # A byte-level BPE with Qwen's added tokens (no [IMG] ones), small enough for the debug
    # model's 512 embeddings.
    make_hf_tokenizer_dir(tmp_path, QWEN_SPECIAL_TOKENS)
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.token_to_id("[IMG]") is None and tokenizer.get_vocab_size() <= 512
    steps = 2
    run = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "train_configs/vlm_shapes.toml",
            "--job.dump_folder",
            str(tmp_path / "run"),
            "--model.hf_assets_path",
            str(tmp_path),
            "--training.steps",
            str(steps),
            "--training.global_batch_size",
            "4",
            "--metrics.log_freq",
            "1",
        ],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    # The default run says nothing about torchdata's internals.
    assert "set_vital" not in run.stderr + run.stdout
    scalars = read_scalars(str(tmp_path / "run" / "tb"))
    assert scalars["data/num_images"][steps] > 0


def test_vlm_grpo_recipe_trains_on_image_prompts_on_two_ranks(tmp_path):
    """``train_configs/vlm_grpo.toml``, shortened: the SFT warm-up on shapes images, then RL steps
    whose sampler (prefilling the prompts' images) and trainer agree on every completion token's
    log-prob, with held-out accuracy before and after and the generation phases timed. Whether
    the full recipe's reward rises is measured by scripts/benchmark_vlm_grpo.py."""
    steps = 3
    log = train_on_two_ranks(
        "vlm_grpo.toml",
        tmp_path,
        "--rl.sft_warmup_steps",
        "10",
        "--training.steps",
        str(steps),
        "--rl.eval_interval",
        str(steps),
        "--rl.num_eval_prompts",
        "8",
        "--rl.group_size",
        "4",
    )
    assert "SFT warm-up: 10 steps on the shapes task" in log
    scalars = read_scalars(str(tmp_path / "tb"))
    assert sorted(scalars["eval/pass@1"]) == [0, steps]
    for tag in ("rl/reward_mean", "time/generate_prefill_s", "time/generate_decode_s", "time/train_s"):
        assert sorted(scalars[tag]) == list(range(1, steps + 1)), tag
    assert all(value > 0 for value in scalars["time/generate_prefill_s"].values())
    # Sampler and trainer both see the images: their log-probs of the sampled tokens agree.
    assert all(value < 1e-4 for value in scalars["rl/sampler_logprob_diff_max"].values())
    assert len(scalars["sft_warmup/loss"]) == 10
    # The dump names every prompt's images (the shapes task draws one per prompt).
    for kind in rollout_files.KINDS:
        folder = str(tmp_path / kind)
        for step in rollout_files.dumped_steps(folder):
            for record in rollout_files.read_step(folder, step):
                [image] = record["images"]
                assert image["where"] and min(image["grid"]) > 0 and image["source"], record["images"]
    assert rollout_files.dumped_steps(str(tmp_path / "evals")) == [0, steps]
