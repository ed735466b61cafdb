"""``train.py`` fine-tunes a Hugging Face Qwen3 directory and exports the result for transformers.

A tiny Qwen3 of the ``debugmodel`` flavor is created locally with transformers (no download).
Two gloo ranks (FSDP) load it; the first logged loss must be the loss transformers computes
on the same first mini-batch. The run exports its last step in HF format; a second run
starting from that export must again log exactly what transformers computes with it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from reference import launch_env, train_in_process
from torchtitan_rl.config import ConfigManager
from torchtitan_rl.data.datasets import load_rows
from torchtitan_rl.data.loader import SFTDataLoader
from torchtitan_rl.data.tokenizer import build_tokenizer
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.tensorboard_io import read_scalars

REPO = Path(__file__).resolve().parents[2]
SEED, SEQ_LEN, BATCH, STEPS = 42, 64, 8, 2
ARGS = [
    "--job.config_file",
    str(REPO / "train_configs" / "debug_model.toml"),
    "--debug.seed",
    str(SEED),
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    str(SEQ_LEN),
    "--training.global_batch_size",
    str(BATCH),
    "--training.max_tokens_per_microbatch",
    "128",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "0",
    "--checkpoint.enable",
    "true",
    "--checkpoint.initial_load_in_hf",
    "true",
    "--checkpoint.last_save_model_only",
    "true",
    "--checkpoint.last_save_in_hf",
    "true",
]
LOSS = "loss_metrics/global_avg_loss"


def finetune(initial: Path, dump: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "train.py"),
        *ARGS,
        "--checkpoint.initial_load_path",
        str(initial),
        "--job.dump_folder",
        str(dump),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "loaded Hugging Face weights" in proc.stdout + proc.stderr
    return read_scalars(str(dump / "tb"))


def first_batch_loss(hf: Qwen3ForCausalLM) -> float:
    """token_mean cross-entropy of the run's first global mini-batch, each sequence alone in HF."""
    t = ConfigManager().parse_args([*ARGS, "--checkpoint.initial_load_path", "x"]).training  # the run's data settings
    rows = load_rows(t.dataset, t.dataset_path, t.dataset_split, t.num_synthetic_samples, SEED)
    loader = SFTDataLoader(rows, build_tokenizer(""), SEQ_LEN, BATCH, t.long_sample_policy, SEED, 0, 1)
    total, count = 0.0, 0
    with torch.no_grad():
        for s in next(iter(loader)):
            logits = hf(s.input_ids[None]).logits[0]
            losses = F.cross_entropy(logits.double(), s.labels, reduction="none")
            total += float((losses * s.loss_mask).sum())
            count += int(s.loss_mask.sum())
    return total / count


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = Qwen3Config(**qwen3_flavors["debugmodel"].to_hf_config("float32"))
    folder = tmp_path_factory.mktemp("hf") / "tiny-qwen3"
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def test_finetune_from_hf_and_export_back(hf_dir, tmp_path):
    run = finetune(hf_dir, tmp_path / "first")
    original = Qwen3ForCausalLM.from_pretrained(hf_dir)
    assert run[LOSS][1] == pytest.approx(first_batch_loss(original), rel=1e-5)

    export = tmp_path / "first" / "checkpoint" / f"step-{STEPS}"
    assert json.loads((export / "checkpoint.json").read_text())["format"] == "hf"
    exported, info = Qwen3ForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    trained = any(not torch.equal(a, b) for a, b in zip(original.state_dict().values(), exported.state_dict().values()))
    assert trained, "the export holds the initial weights, not the trained ones"

    again = finetune(export, tmp_path / "second")
    assert again[LOSS][1] == pytest.approx(first_batch_loss(exported), rel=1e-5)


def test_hf_directory_of_another_flavor_is_refused_before_training(hf_dir, tmp_path):
    args = [*ARGS, "--checkpoint.initial_load_path", str(hf_dir), "--model.flavor", "0.6B"]
    proc = train_in_process([*args, "--job.dump_folder", str(tmp_path / "wrong")])
    assert proc.returncode == 2
    assert "another model flavor" in proc.stderr and str(hf_dir / "config.json") in proc.stderr
    assert "model.flavor='debugmodel'" in proc.stderr  # it says which flavor the directory is


def test_any_qwen3_size_fine_tunes_with_the_hf_flavor(tmp_path):
    """model.flavor = "hf": an HF Qwen3 that matches no named flavor takes its architecture
    from its config.json, and the first loss is transformers' on the same mini-batch."""
    torch.manual_seed(1)
    config = Qwen3Config(
        vocab_size=300,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=16,
        intermediate_size=80,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
    )
    folder = tmp_path / "custom-qwen3"
    Qwen3ForCausalLM(config).save_pretrained(folder)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "train.py"),
        *ARGS,
        "--model.flavor",
        "hf",
        "--checkpoint.initial_load_path",
        str(folder),
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    loss = read_scalars(str(tmp_path / "run" / "tb"))[LOSS][1]
    assert loss == pytest.approx(first_batch_loss(Qwen3ForCausalLM.from_pretrained(folder)), rel=1e-5)


def test_hf_flavor_needs_a_config_json(tmp_path):
    proc = train_in_process(["--model.flavor", "hf", "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2
    assert (
        "model.flavor: 'hf' takes the architecture from the config.json of checkpoint.initial_load_path" in proc.stderr
    )
