"""HF checkpoints in and out of FSDP2 / HSDP / TP / CP-sharded models (4 gloo ranks, one launch).

Each rank reads only its blocks of the safetensors files (of a Qwen3-MoE: only its experts);
the gathered parameters must equal the tensors transformers wrote, bit for bit, and so must the
files each sharded model exports.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

import hf_load_worker
from reference import launch_env
from torchtitan_rl.hf_checkpoint import read_hf_model_args
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
from unit.test_hf_checkpoint import read_tensors
from unit.test_moe import COEF as MOE_AUX_LOSS_COEF
from unit.test_moe import hf_config as moe_hf_config
from unit.test_qwen3_model import hf_config

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {
    # Heads, KV heads, hidden units and vocabulary divide by tp = 4; dim 62 does not divide by
    # dp = 4, so FSDP shards of norms, o_proj and down_proj are uneven.
    "divisible": Qwen3ModelArgs(
        vocab_size=96,
        dim=62,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        head_dim=8,
        hidden_dim=72,
        rope_theta=10_000.0,
        max_seq_len=64,
    ),
    # With tp = 2, TP shards of 49 vocabulary rows and 35 hidden units split unevenly over dp = 2.
    "odd": Qwen3ModelArgs(
        vocab_size=98,
        dim=62,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        hidden_dim=70,
        rope_theta=10_000.0,
        tie_embeddings=True,
        max_seq_len=64,
    ),
    # Qwen3-MoE with a dense first layer: stacked experts (4, one per rank of a 4-rank expert
    # mesh) read from and written as per-expert HF tensors.
    "moe": Qwen3ModelArgs(
        vocab_size=96,
        dim=64,
        n_layers=3,
        n_heads=8,
        n_kv_heads=4,
        head_dim=8,
        hidden_dim=72,
        rope_theta=10_000.0,
        max_seq_len=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_hidden_dim=32,
        mlp_only_layers=(0,),
    ),
}


def write_checkpoints(directory: str) -> dict[str, dict[str, torch.Tensor]]:
    """Random HF models (every tensor, norms included, distinct) saved sharded; their tensors as written."""
    references = {}
    for i, (name, args) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        hf = Qwen3MoeForCausalLM(moe_hf_config(args)) if args.is_moe else Qwen3ForCausalLM(hf_config(args))
        with torch.no_grad():
            for p in hf.parameters():
                p.uniform_(-1, 1)
        hf.save_pretrained(os.path.join(directory, name), max_shard_size=30_000)
        references[name] = read_tensors(os.path.join(directory, name))
    return references


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    checkpoints, out = tmp_path_factory.mktemp("hf"), tmp_path_factory.mktemp("out")
    references = write_checkpoints(str(checkpoints))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={hf_load_worker.WORLD_SIZE}",
        os.path.join(HERE, "hf_load_worker.py"),
        str(checkpoints),
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=HERE, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return references, str(out), torch.load(os.path.join(out, "loaded.pt"))


@pytest.mark.parametrize("case", hf_load_worker.CASES)
def test_sharded_load_and_export_equal_the_hf_tensors(launched, case):
    references, out, loaded = launched
    checkpoint = hf_load_worker.CASES[case][0]
    expected = references[checkpoint]
    assert loaded[case].keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(loaded[case][key], tensor), f"{case}: loaded {key}"
    exported = read_tensors(os.path.join(out, case))
    assert exported.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(exported[key], tensor), f"{case}: exported {key}"
    # The export writes the imported config.json's values, the MoE balance-loss coefficient included.
    args = MODELS[checkpoint]
    if args.is_moe:
        args = dataclasses.replace(args, router_aux_loss_coef=MOE_AUX_LOSS_COEF)
    assert read_hf_model_args(os.path.join(out, case)) == args
