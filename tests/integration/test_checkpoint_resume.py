"""Stop, crash and resume ``train.py`` runs (2 gloo ranks): the resumed curve is the uninterrupted one.

One uninterrupted run of 6 steps saves at steps 3 and 6. Copies of its dump folder without
step 6 stand for a run stopped after step 3; restarting ``train.py`` on them must continue
from step 3: bit-identically on the same layout (also the data counters: no sample is
repeated or skipped), within float tolerance on dp=4 and on cp=2 x tp=2. A run killed while writing step 6's
checkpoint must leave it ignored and resume from step 3. With LoRA, checkpoints hold the
adapters only and the resumed run ends with the same adapter export.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reference import launch_env
from torchtitan_rl.checkpoint import step_folders
from torchtitan_rl.tensorboard_io import read_scalars

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS, INTERVAL = 6, 3
ARGS = [
    "--job.config_file",
    str(REPO / "train_configs" / "debug_model.toml"),
    "--training.steps",
    str(STEPS),
    "--training.global_batch_size",
    "8",
    "--training.seq_len",
    "64",
    "--training.max_tokens_per_microbatch",
    "128",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    str(INTERVAL),
]
# Everything a step logs that does not depend on wall-clock time or memory.
EXACT_TAGS = (
    "loss_metrics/global_avg_loss",
    "loss_metrics/global_max_loss",
    "grad_norm",
    "lr",
    "tokens/loss_tokens",
    "tokens/total",
    "data/num_samples",
    "data/num_truncated",
)


def run(dump: Path, nproc: int, *extra: str, script: Path = REPO / "train.py", env: dict | None = None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *ARGS,
        "--job.dump_folder",
        str(dump),
        *extra,
    ]
    return subprocess.run(cmd, cwd=REPO, env=env or launch_env(), capture_output=True, text=True, timeout=600)


def check(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def stopped_after_step_3(source: Path, dest: Path) -> Path:
    """The uninterrupted run's folder as it was right after step 3's checkpoint."""
    shutil.copytree(source, dest)
    shutil.rmtree(dest / "checkpoint" / "step-6")
    shutil.rmtree(dest / "tb")
    return dest


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("ckpt") / "uninterrupted"
    check(run(dump, 2))
    assert sorted(step_folders(str(dump / "checkpoint"))) == [3, 6]
    return dump


def test_resume_on_same_layout_is_bit_identical(uninterrupted, tmp_path):
    dump = stopped_after_step_3(uninterrupted, tmp_path / "resumed")
    out = check(run(dump, 2))
    assert "resuming after step 3" in out
    full, resumed = read_scalars(str(uninterrupted / "tb")), read_scalars(str(dump / "tb"))
    for tag in EXACT_TAGS:
        assert sorted(resumed[tag]) == [4, 5, 6], tag  # no step is trained twice
        for step in (4, 5, 6):
            assert resumed[tag][step] == full[tag][step], (tag, step)
    # The data position came back: the global sample counter continues, not restarts.
    assert resumed["data/num_samples"][4] == full["data/num_samples"][3] + 8


@pytest.mark.parametrize(
    "layout",
    [
        [],  # dp=4 (FSDP over 4 ranks)
        ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],  # dp=1, cp=2, tp=2
        ["--parallelism.pipeline_parallel_degree", "2"],  # two pipeline stages, each FSDP over 2 ranks
    ],
    ids=["dp4", "cp2_tp2", "pp2_dp2"],
)
def test_resume_on_another_layout_continues(uninterrupted, tmp_path, layout):
    dump = stopped_after_step_3(uninterrupted, tmp_path / "other_layout")
    out = check(run(dump, 4, *layout))
    assert "resuming after step 3" in out
    full, resumed = read_scalars(str(uninterrupted / "tb")), read_scalars(str(dump / "tb"))
    for step in (4, 5, 6):
        for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
            assert resumed[tag][step] == pytest.approx(full[tag][step], rel=1e-4), (tag, step)
        for tag in ("tokens/loss_tokens", "tokens/total", "data/num_samples"):
            assert resumed[tag][step] == full[tag][step], (tag, step)


HF_LAST = ["--checkpoint.last_save_in_hf", "true", "--checkpoint.last_save_model_only", "true"]


def test_pipeline_run_trains_resumes_without_pipeline_and_exports_alike(uninterrupted, tmp_path):
    """A pp2 run (one stage per rank) follows the data-parallel run's curve; stopped after step 3
    it resumes on dp2 (no pipeline), and both end with the same Hugging Face export, whose
    files the pipeline's two stages wrote."""
    piped = tmp_path / "pp2"
    check(run(piped, 2, "--parallelism.pipeline_parallel_degree", "2", *HF_LAST))
    full, curve = read_scalars(str(uninterrupted / "tb")), read_scalars(str(piped / "tb"))
    for step in range(1, STEPS + 1):
        assert curve["loss_metrics/global_avg_loss"][step] == pytest.approx(
            full["loss_metrics/global_avg_loss"][step], rel=1e-4
        )
        assert curve["grad_norm"][step] == pytest.approx(full["grad_norm"][step], rel=1e-4)
    resumed = tmp_path / "resumed"
    shutil.copytree(piped, resumed)
    shutil.rmtree(resumed / "checkpoint" / "step-6")
    shutil.rmtree(resumed / "tb")
    out = check(run(resumed, 2, *HF_LAST))
    assert "resuming after step 3" in out
    again = read_scalars(str(resumed / "tb"))
    for step in (4, 5, 6):
        assert again["loss_metrics/global_avg_loss"][step] == pytest.approx(
            curve["loss_metrics/global_avg_loss"][step], rel=1e-4
        )
    exported = {}
    for name, dump in (("pp2", piped), ("dp2", resumed)):
        folder = dump / "checkpoint" / "step-6"
        exported[name] = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert len(list((piped / "checkpoint" / "step-6").glob("*.safetensors"))) == 2  # one per stage
    assert exported["pp2"].keys() == exported["dp2"].keys()
    for key, tensor in exported["dp2"].items():
        torch.testing.assert_close(exported["pp2"][key], tensor, rtol=1e-3, atol=1e-5, msg=key)


def test_save_killed_midway_is_ignored_and_previous_checkpoint_loads(uninterrupted, tmp_path):
    dump = tmp_path / "crashed"
    proc = run(dump, 2, script=HERE / "crash_during_save.py", env=dict(launch_env(), CRASH_IN_SAVE="step-6"))
    assert proc.returncode != 0, "the simulated kill did not happen"
    folder = dump / "checkpoint"
    assert (folder / "step-6.partial").is_dir() and any((folder / "step-6.partial").iterdir())
    assert sorted(step_folders(str(folder))) == [3]
    shutil.rmtree(dump / "tb")
    # Restart, saving in the background this time: same curve, step 6 completes.
    out = check(run(dump, 2, "--checkpoint.async_mode", "async"))
    assert "resuming after step 3" in out
    assert sorted(step_folders(str(folder))) == [3, 6] and not (folder / "step-6.partial").exists()
    full, resumed = read_scalars(str(uninterrupted / "tb")), read_scalars(str(dump / "tb"))
    for tag in EXACT_TAGS:
        assert [resumed[tag][s] for s in (4, 5, 6)] == [full[tag][s] for s in (4, 5, 6)], tag


MOE_ARGS = [
    "--model.flavor",
    "debugmodel_moe",
    "--moe.aux_loss_coef",
    "0.01",
    "--moe.z_loss_coef",
    "0.001",
    "--parallelism.tensor_parallel_degree",
    "2",
    "--parallelism.expert_parallel_degree",
    "2",
]


def test_moe_resume_on_same_layout_is_bit_identical(tmp_path):
    """Stacked experts split over expert parallel (ep 2 over the tp pair: each rank its own
    experts, FSDP over one rank), beside TP-sharded dense weights: two meshes, two optimizer
    parameter groups; the router losses and the ep ranks' load resume exactly."""
    uninterrupted_moe = tmp_path / "moe"
    check(run(uninterrupted_moe, 2, *MOE_ARGS))
    dump = stopped_after_step_3(uninterrupted_moe, tmp_path / "moe_resumed")
    assert "resuming after step 3" in check(run(dump, 2, *MOE_ARGS))
    full, resumed = read_scalars(str(uninterrupted_moe / "tb")), read_scalars(str(dump / "tb"))
    for tag in (*EXACT_TAGS, "moe/aux_loss", "moe/z_loss", "moe/load_imbalance/layer_1", "moe/rank_imbalance/layer_1"):
        assert [resumed[tag][s] for s in (4, 5, 6)] == [full[tag][s] for s in (4, 5, 6)], tag


def test_checkpoint_written_with_activation_checkpointing_loads_without_it(uninterrupted, tmp_path):
    """Activation checkpointing keeps parameter names: a run saved with it resumes without it
    and continues as the run that never used it."""
    with_ac = tmp_path / "with_ac"
    check(run(with_ac, 2, "--activation_checkpoint.mode", "full"))
    dump = stopped_after_step_3(with_ac, tmp_path / "without_ac")
    assert "resuming after step 3" in check(run(dump, 2))
    full, resumed = read_scalars(str(uninterrupted / "tb")), read_scalars(str(dump / "tb"))
    for tag in EXACT_TAGS:
        assert [resumed[tag][s] for s in (4, 5, 6)] == pytest.approx([full[tag][s] for s in (4, 5, 6)], rel=1e-6), tag


LORA_ARGS = [
    "--lora.enable",
    "true",
    "--lora.rank",
    "4",
    "--lora.train_embeddings",
    "true",
    "--checkpoint.last_save_model_only",
    "true",
    "--checkpoint.last_save_in_hf",
    "true",
    "--lora.export_merged",
    "true",
]


def test_lora_resume_on_same_layout_is_bit_identical(tmp_path):
    """Adapter-only checkpoints (dp=2, FSDP-sharded adapters): the resumed run initializes its
    frozen base from the seed again, restores the adapters and their optimizer state, and ends
    with the same PEFT adapter export as the uninterrupted run."""
    full_dump = tmp_path / "lora"
    check(run(full_dump, 2, *LORA_ARGS))
    assert sorted(step_folders(str(full_dump / "checkpoint"))) == [3, 6]
    dump = stopped_after_step_3(full_dump, tmp_path / "lora_resumed")
    assert "resuming after step 3" in check(run(dump, 2, *LORA_ARGS))
    full, resumed = read_scalars(str(full_dump / "tb")), read_scalars(str(dump / "tb"))
    for tag in EXACT_TAGS:
        assert [resumed[tag][s] for s in (4, 5, 6)] == [full[tag][s] for s in (4, 5, 6)], tag
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        a, b = (load_file(str(d / "checkpoint" / "step-6" / name)) for d in (full_dump, dump))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
