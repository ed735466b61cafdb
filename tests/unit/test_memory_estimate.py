"""The memory estimator's parts against what the code really holds: the bytes a forward saves
for backward (autograd's saved-tensor hooks, every storage counted once), a rank's parameter
shards (the model FSDP and TP build on meta, brute force), the layout search and the CLI.
Whole-run peaks against measured memory: tests/integration/test_memory_measured.py."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan_rl.config import ConfigManager
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.estimate.activations import MicroBatch, forward_memory, vision_tower_bytes
from torchtitan_rl.estimate.memory import GIB, estimate_memory
from torchtitan_rl.estimate.params import local_numel, meta_model, shard_model
from torchtitan_rl.estimate.search import search_layouts
from torchtitan_rl.models.lora import LoRASettings
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.models.vision.model import VisionTransformer
from torchtitan_rl.models.vlm.args import vlm_flavors

REPO = Path(__file__).resolve().parents[2]


def _saved_bytes(model: torch.nn.Module, run) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs, parameters excepted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


@pytest.mark.parametrize(
    "flavor, dtype, lengths, lora",
    [
        ("debugmodel", torch.float32, [64, 32] * 8, False),
        ("debugmodel", torch.float32, [96, 40, 40, 96, 17], False),
        ("debugmodel", torch.bfloat16, [64, 32] * 8, False),
        ("debugmodel", torch.float32, [64, 32] * 8, True),
        ("debugmodel_moe", torch.float32, [64, 32] * 8, False),
    ],
)
def test_saved_activations_equal_what_autograd_keeps(flavor, dtype, lengths, lora):
    """Documents of several lengths, as packing makes them (documents all of one length let the
    CPU's attention skip a copy: the estimate is high by that copy there)."""
    args = dataclasses.replace(qwen3_flavors[flavor], attn_backend="sdpa_varlen")
    settings = LoRASettings(rank=8, alpha=16.0, dropout=0.0, target_modules=("wq", "wv", "wo", "w2")) if lora else None
    torch.manual_seed(0)
    model = meta_model(args, settings).to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    num_tokens = sum(lengths)
    tokens = torch.randint(0, args.vocab_size, (num_tokens,))
    positions = torch.cat([torch.arange(n) for n in lengths])
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    measured = _saved_bytes(model, lambda: model(tokens, positions, seq_ids))
    adapted = frozenset(settings.target_modules) if lora else frozenset()
    mb = MicroBatch(num_tokens, 1, dtype.itemsize, 8 if lora else 0, adapted, frozen_input=lora)
    estimated = forward_memory(args, [tuple(range(args.n_layers))], mb, "none", 1).saved
    # The final norm, which the estimate books under the loss (loss_bytes).
    estimated += mb.norm(num_tokens, args.dim)
    # Uneven lengths pad a few documents into the kernel's batch: 1 % at most here.
    assert estimated == pytest.approx(measured, rel=0.01)


def test_saved_vision_activations_equal_what_autograd_keeps():
    args = dataclasses.replace(vlm_flavors["debugmodel"].vision, attn_backend="sdpa_varlen")
    torch.manual_seed(0)
    tower = VisionTransformer(args)
    grids = [(8, 8), (4, 6), (8, 8), (4, 6)]  # images of two sizes, as packing mixes them
    num_patches = sum(rows * cols for rows, cols in grids)
    patches = torch.randn(num_patches, args.patch_dim)
    measured = _saved_bytes(tower, lambda: tower(patches, grids))
    assert vision_tower_bytes(args, num_patches, 4) == pytest.approx(measured, rel=0.01)


def test_checkpointed_blocks_keep_only_their_input():
    args = dataclasses.replace(qwen3_flavors["debugmodel"], attn_backend="sdpa_varlen")
    mb = MicroBatch(512, 1, 4)
    full = forward_memory(args, [(0, 1)], mb, "none", 1)
    checkpointed = forward_memory(args, [(0, 1)], mb, "full", 1)
    selective = forward_memory(args, [(0, 1)], mb, "selective", 2)
    # Two pipeline stages of one block each: each stage checkpoints its first block.
    assert forward_memory(args, [(0,), (1,)], mb, "selective", 2) == checkpointed
    rotary = 2 * 512 * args.head_dim * 4
    block, block_input = (full.saved - rotary) // 2, 512 * args.dim * 4
    gradients = (3 * 512 * args.hidden_dim + 512 * args.dim) * 4
    assert checkpointed.saved == 2 * block_input + rotary
    # Every second block of (0, 1): block 0 is recomputed, block 1 keeps everything.
    assert selective.saved == block_input + block + rotary
    # Rebuilding block 1 under full checkpointing: block 0's input is still kept.
    assert checkpointed.rebuild == rotary + block_input + block + gradients
    assert (full.rebuild, selective.rebuild) == (0, rotary + block + gradients)


def _brute_force_local(name, shape, tp, ep, fsdp_degree, expert_fsdp_degree):
    """The slice one rank holds, counted by cutting a tensor of that shape as the layout does."""
    t = torch.empty(shape, device="meta")
    if ".moe.experts." in name:
        t = t.chunk(ep, 0)[0]
        degree = expert_fsdp_degree
    else:
        if name.startswith("tok_embeddings") or any(k in name for k in ("wq", "wk", "wv", "w1", "w3", "output")):
            t = t if ".lora_a." in name else t.chunk(tp, 0)[0]
        elif any(k in name for k in ("wo", "w2")):
            t = t if ".lora_b." in name else t.chunk(tp, 1)[0]
        degree = fsdp_degree
    rows = -(-t.shape[0] // degree)  # FSDP2 pads dim 0 to a multiple of the degree
    return rows * t[0].numel() if t.dim() > 1 else rows


@pytest.mark.parametrize("flavor, lora", [("debugmodel", False), ("debugmodel", True), ("debugmodel_moe", False)])
def test_parameter_shards_match_brute_force(flavor, lora):
    args = qwen3_flavors[flavor]
    settings = LoRASettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("wq", "wo", "w2")) if lora else None
    model = meta_model(args, settings)
    dims = ParallelDims(dp_replicate=1, dp_shard=3, cp=1, tp=2, world_size=6, ep=2 if args.is_moe else 1)
    shard = shard_model(model, dims)
    expected_trainable = expected_frozen = 0
    for name, p in model.named_parameters():
        n = _brute_force_local(name, p.shape, 2, dims.ep, 3, dims.expert_fsdp_degree)
        assert local_numel(name, p.shape, dims, fsdp=True) == n, name
        if p.requires_grad:
            expected_trainable += n
        else:
            expected_frozen += n
    assert (shard.trainable, shard.frozen) == (expected_trainable, expected_frozen)
    whole = shard_model(model, ParallelDims(1, 1, 1, 1, 1))
    assert whole.trainable + whole.frozen == sum(p.numel() for p in model.parameters())


def _config(*argv: str):
    return ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), *argv])


def test_layouts_found_fit_and_are_sorted():
    config = _config(
        "--model.flavor",
        "0.6B",
        "--training.seq_len",
        "4096",
        "--training.global_batch_size",
        "16",
        "--training.max_tokens_per_microbatch",
        "0",
    )
    args = qwen3_flavors["0.6B"]
    budget = 16 * GIB
    found = search_layouts(config, args, 8, budget)
    assert found, "no layout of 8 ranks fits 16 GiB"
    assert all(c.peak <= budget for c in found)
    assert [c.seconds for c in found] == sorted(c.seconds for c in found)
    # Each candidate's figures are those of estimating its layout directly.
    best = found[0]
    for key, value in best.parallelism.items():
        setattr(config.parallelism, key, value)
    config.activation_checkpoint.mode = best.ac_mode
    direct = estimate_memory(config, args, ParallelDims.from_config(config.parallelism, 8), None, "bfloat16")
    assert max(e.peak for e in direct) == best.peak
    # The 0.6B model ties its embeddings: pipeline parallel cannot split it.
    assert all(c.parallelism["pipeline_parallel_degree"] == 1 for c in found)
    # No activation checkpointing with the whole batch in one micro-batch cannot fit 16 GiB.
    tight = [
        c for c in found if c.parallelism["tensor_parallel_degree"] * c.parallelism["context_parallel_degree"] == 1
    ]
    assert all(c.ac_mode != "none" for c in tight)


def _train(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_estimate_cli_prints_the_table_and_the_verdict():
    done = _train("--estimate", "--estimate.world_size", "2", "--estimate.device_memory", "0.02")
    assert done.returncode == 0, done.stderr
    config = _config()
    estimate = estimate_memory(config, qwen3_flavors["debugmodel"], ParallelDims.from_config(config.parallelism, 2))
    assert f"peak {estimate[0].peak / GIB:.2f} GiB" in done.stdout
    assert ("does NOT fit" in done.stdout) == (estimate[0].peak > 0.02 * GIB)
    bad = _train("--estimate", "--estimate.world_size", "3", "--parallelism.tensor_parallel_degree", "2")
    assert bad.returncode == 2
    assert "parallelism.tensor_parallel_degree" in bad.stderr


def test_estimate_keys_without_estimate_are_an_error():
    with pytest.raises(ValueError, match=r"estimate\.search: only used with --estimate"):
        _config("--estimate.search", "true")
    assert _config("--estimate.enable", "true", "--estimate.search", "true").estimate.search


@pytest.mark.parametrize("flavor, recipe", [("8B", "SFT"), ("0.6B", "GRPO")])
def test_the_readme_sizing_table_is_the_estimators_output(flavor, recipe):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import sizing_table
    finally:
        sys.path.remove(str(REPO / "scripts"))
    seq_len, budget = sizing_table.LENGTHS[0]
    line = sizing_table.row(flavor, recipe, seq_len, budget)
    assert "none fits" not in line
    assert line in (REPO / "README.md").read_text(), "README.md is stale: run python scripts/sizing_table.py"


def test_routing_replay_adds_each_tokens_recorded_experts_to_the_rollouts():
    def rollouts(*argv: str) -> int:
        config = ConfigManager().parse_args(
            [
                "--job.config_file",
                str(REPO / "train_configs/debug_grpo.toml"),
                "--model.flavor",
                "debugmodel_moe",
                *argv,
            ]
        )
        (estimate,) = estimate_memory(
            config, qwen3_flavors["debugmodel_moe"], ParallelDims.from_config(config.parallelism, 2)
        )
        return next(item.bytes for item in estimate.items if item.name == "rollouts")

    args = qwen3_flavors["debugmodel_moe"]
    config = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs/debug_grpo.toml")])
    # This rank's rollout tokens: its share of the step's samples, seq_len each.
    tokens = (
        config.rl.prompts_per_step * config.rl.group_size // 2 * config.rl.num_minibatches * config.training.seq_len
    )
    extra = rollouts("--moe.router_replay", "rollout") - rollouts()
    assert extra == tokens * len(args.moe_layers) * args.num_experts_per_tok * 2  # int16 ids
