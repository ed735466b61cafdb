"""Qwen3-MoE through hf_checkpoint: a directory transformers wrote (per-expert tensors) loads
into our stacked experts, and our export has transformers' key names, reloads with the same
logits and writes the balance-loss settings in force; config.json errors name file and field."""

import json
import os

import pytest
import torch
from transformers import AutoConfig, Qwen3MoeForCausalLM

from test_hf_checkpoint import read_tensors
from test_moe import COEF, hf_and_ours, pack, sequences, tiny_args
from torchtitan_rl.config import ConfigManager
from torchtitan_rl.hf_checkpoint import load_hf_weights, read_hf_model_args, save_hf_checkpoint
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors, with_router_aux_loss
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
    assert args == tiny_args(router_aux_loss_coef=COEF)  # the balance-loss weight transformers wrote
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
    assert (reloaded.config.router_aux_loss_coef, reloaded.config.output_router_logits) == (COEF, False)
    reloaded.config._attn_implementation = "eager"
    reloaded.config._experts_implementation = "eager"
    torch.testing.assert_close(hf_logits(reloaded.eval(), seqs), hf_logits(hf, seqs), rtol=1e-5, atol=1e-5)


def balance_loss_settings(config: dict) -> tuple[float, bool]:
    return config["router_aux_loss_coef"], config["output_router_logits"]


def test_balance_loss_settings_round_trip_and_training_override(tmp_path):
    imported = {**tiny_args().to_hf_config("float32"), "router_aux_loss_coef": 0.02, "output_router_logits": True}
    args = Qwen3ModelArgs.from_hf_config(imported)
    assert balance_loss_settings(args.to_hf_config("float32")) == (0.02, True)
    # A run without a balance loss (moe.aux_loss_coef = 0, the default) keeps the imported values.
    assert with_router_aux_loss(args, 0.0) is args
    # A run with one writes its coefficient, and asks HF for router logits (HF's loss needs them).
    cfg = ConfigManager().parse_args(["--model.flavor", "debugmodel_moe", "--moe.aux_loss_coef", "0.05"])
    trained = with_router_aux_loss(args, cfg.moe.aux_loss_coef)
    assert balance_loss_settings(trained.to_hf_config("float32")) == (0.05, True)
    # A named flavor starts from transformers' defaults (those of the published checkpoints).
    assert balance_loss_settings(qwen3_flavors["debugmodel_moe"].to_hf_config("float32")) == (0.001, False)

    # Through the export, read back by transformers.
    out = str(tmp_path / "export")
    save_hf_checkpoint(Qwen3Model(trained), out, torch.float32)
    exported = AutoConfig.from_pretrained(out)
    assert (exported.router_aux_loss_coef, exported.output_router_logits) == (0.05, True)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in [1, num_experts=8]"),
        (
            {"mlp_only_layers": [1, 7]},
            "mlp_only_layers lists [7], which are not layers of a model with num_hidden_layers=4",
        ),
        (
            {"decoder_sparse_step": 5, "mlp_only_layers": []},
            "num_experts=8 but no layer is MoE (decoder_sparse_step=5, mlp_only_layers=[])",
        ),
        ({"router_aux_loss_coef": -0.1}, "router_aux_loss_coef must be a finite number >= 0, got -0.1"),
    ],
)
def test_moe_errors_of_a_config_name_the_file_and_field(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**tiny_args().to_hf_config("float32"), **change}))
    with pytest.raises(ValueError) as error:
        read_hf_model_args(str(tmp_path))
    assert str(error.value) == f"{tmp_path / 'config.json'}: {message}"
