"""Qwen3-MoE through hf_checkpoint: a directory transformers wrote (per-expert tensors) loads
into our stacked experts, and our export has transformers' key names and reloads with the same
logits."""

import os

import torch
from transformers import Qwen3MoeForCausalLM

from test_hf_checkpoint import read_tensors
from test_moe import hf_and_ours, pack, sequences, tiny_args
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args, save_hf_checkpoint
from torchtitan_rl.models.qwen3.model import Qwen3Model


def packed_logits(model: Qwen3Model, seqs) -> torch.Tensor:
    tokens, positions, seq_ids, router_mask = pack(seqs)
    hidden, _ = model(tokens, positions, seq_ids, router_mask=router_mask, num_seqs=len(seqs))
    return model.output(hidden)


def hf_logits(hf, seqs) -> torch.Tensor:
    return torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])


@torch.no_grad()
def test_hf_moe_directory_loads_and_exports_with_hf_names_and_logits(tmp_path):
    hf, _ = hf_and_ours()
    hf.save_pretrained(tmp_path / "hf", max_shard_size=100_000)
    written = read_tensors(str(tmp_path / "hf"))
    assert any(".mlp.experts.3.up_proj.weight" in key for key in written)  # per-expert on disk
    args = read_hf_model_args(str(tmp_path / "hf"))
    assert args == tiny_args()
    model = Qwen3Model(args)
    load_hf_weights(model, str(tmp_path / "hf"))
    seqs = sequences()
    torch.testing.assert_close(packed_logits(model, seqs), hf_logits(hf, seqs), rtol=1e-5, atol=1e-5)

    out = str(tmp_path / "export")
    save_hf_checkpoint(model, out, torch.float32, max_shard_bytes=100_000)
    exported = read_tensors(out)
    assert exported.keys() == written.keys()
    assert all(torch.equal(exported[key], tensor) for key, tensor in written.items())
    assert len([name for name in os.listdir(out) if name.endswith(".safetensors")]) > 1
    reloaded, info = Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    reloaded.config._attn_implementation = "eager"
    reloaded.config._experts_implementation = "eager"
    torch.testing.assert_close(hf_logits(reloaded.eval(), seqs), hf_logits(hf, seqs), rtol=1e-5, atol=1e-5)
