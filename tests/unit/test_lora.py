"""LoRA layers against brute-force formulas: the adapted linear, which layers each family adapts
(and freezes), the merged weights, the initial adapters, a bfloat16 base, and config errors."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from test_config import assert_error, parse
from test_vlm_model import small_args as small_vlm_args
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.models.lora import (
    LoRALinear,
    LoRASettings,
    adapters_disabled,
    effective_weight,
    is_adapter_key,
    lora_modules,
    merged_weight,
)
from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs, qwen3_flavors
from torchtitan_rl.models.qwen3.model import Qwen3Model
from torchtitan_rl.recipes.base import build_model

ARGS = Qwen3ModelArgs(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48, max_seq_len=64
)
ALL = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")


def build(args=ARGS, **settings) -> torch.nn.Module:
    settings = LoRASettings(**{"rank": 4, "alpha": 8.0, **settings})
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    return build_model(
        args,
        parallel_dims=dims,
        device=torch.device("cpu"),
        seed=3,
        param_dtype=torch.float32,
        lora=settings,
    )


@torch.no_grad()
def randomize_adapters(model, std=0.3):
    gen = torch.Generator().manual_seed(0)
    for fqn, p in model.named_parameters():
        if is_adapter_key(fqn):
            p.copy_(std * torch.randn(p.shape, generator=gen))


def logits(model, ids):
    n = ids.numel()
    hidden = model(ids, torch.arange(n), torch.zeros(n, dtype=torch.long))
    return hidden @ effective_weight(model.output).t()


def test_adapted_linear_is_base_plus_scaled_low_rank_update():
    settings = LoRASettings(rank=3, alpha=12.0)
    layer = LoRALinear(5, 7, True, settings)
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(4, 5)
    expected = x @ layer.weight.t() + layer.bias + 4.0 * (x @ layer.lora_a.weight.t()) @ layer.lora_b.weight.t()
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(x @ effective_weight(layer).t() + layer.bias, expected)
    with adapters_disabled(layer):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.adapters_enabled


def test_every_target_is_adapted_and_everything_else_frozen():
    model = build(target_modules=ALL)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    adapted = [f"layers.{i}.attention.{n}" for i in range(2) for n in ("wq", "wk", "wv", "wo")]
    adapted += [f"layers.{i}.feed_forward.{n}" for i in range(2) for n in ("w1", "w2", "w3")] + ["output"]
    assert trainable == {f"{m}.lora_{ab}.weight" for m in adapted for ab in "ab"}
    # Base names are unchanged, so a checkpoint of the plain model loads into this one.
    assert {n for n, _ in model.named_parameters() if not is_adapter_key(n)} == {
        n for n, _ in Qwen3Model(ARGS).named_parameters()
    }
    wq = model.get_submodule("layers.0.attention.wq")
    assert wq.lora_a.weight.shape == (4, 32) and wq.lora_b.weight.shape == (32, 4)
    embedding = build(target_modules=("wq",), train_embeddings=True)
    assert {n for n, p in embedding.named_parameters() if p.requires_grad} == {
        "tok_embeddings.weight",
        *(f"layers.{i}.attention.wq.lora_{ab}.weight" for i in range(2) for ab in "ab"),
    }


def test_moe_experts_and_router_are_not_adapted():
    args = dataclasses.replace(qwen3_flavors["debugmodel_moe"], n_layers=2, mlp_only_layers=(0,))
    model = build(args, target_modules=("wq", "w1"))
    adapted = {n.rsplit(".", 2)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"layers.0.attention.wq", "layers.1.attention.wq", "layers.0.feed_forward.w1"}
    assert not any(p.requires_grad for n, p in model.named_parameters() if "moe." in n)


def test_vlm_adapts_language_model_and_projector_not_vision_tower():
    model = build(small_vlm_args(projector_bias=True), target_modules=("wq", "projector"))
    adapted = {n.rsplit(".", 2)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {
        "layers.0.attention.wq",
        "layers.1.attention.wq",
        "projector.merger",
        "projector.linear_1",
        "projector.linear_2",
    }
    linear = model.projector.linear_1
    randomize_adapters(model)
    x = torch.randn(3, linear.in_features)
    expected = x @ linear.weight.t() + linear.bias + 2.0 * x @ linear.lora_a.weight.t() @ linear.lora_b.weight.t()
    torch.testing.assert_close(linear(x), expected)


def test_merged_weights_give_the_adapted_models_logits():
    model = build(target_modules=ALL)
    randomize_adapters(model)
    merged = {n: p.detach() for n, p in model.named_parameters() if not is_adapter_key(n)}
    for name, layer in lora_modules(model).items():
        merged[f"{name}.weight"] = merged_weight(layer.weight, layer.lora_a.weight, layer.lora_b.weight, scale=2.0)
    plain = Qwen3Model(ARGS)
    plain.load_state_dict(merged)
    ids = torch.randint(0, 64, (11,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(logits(model, ids), logits(plain, ids), rtol=1e-5, atol=1e-5)
        with adapters_disabled(model):
            base = Qwen3Model(ARGS)
            base.init_weights(3)
            torch.testing.assert_close(logits(model, ids), logits(base, ids), rtol=0, atol=0)


@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
def test_initial_adapters_leave_the_base_model(init):
    model = build(target_modules=("wq", "w2"), init=init)
    for name, p in model.named_parameters():
        if name.endswith("lora_b.weight"):
            assert torch.count_nonzero(p) == 0, name
        elif name.endswith("lora_a.weight"):
            fan_in = p.shape[1]
            if init == "kaiming":
                assert p.abs().max() <= 1 / fan_in**0.5 and p.std() > 0.4 / fan_in**0.5, name
            else:
                assert abs(float(p.detach().std()) - 1 / 4) < 0.05, name
    base = Qwen3Model(ARGS)
    base.init_weights(3)
    ids = torch.arange(9)
    with torch.no_grad():
        torch.testing.assert_close(logits(model, ids), logits(base, ids), rtol=0, atol=0)


def test_bfloat16_base_is_stored_in_bfloat16_and_computed_in_float32():
    model = build(target_modules=("wq", "w1"), base_dtype=torch.bfloat16)
    randomize_adapters(model)
    wq = model.get_submodule("layers.0.attention.wq")
    assert wq.weight.dtype == torch.bfloat16 and wq.lora_a.weight.dtype == torch.float32
    assert model.get_submodule("layers.0.attention.wk").weight.dtype == torch.float32  # not adapted
    reference = build(target_modules=("wq", "w1"))
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q.float())
    ids = torch.arange(13) % 64
    with torch.no_grad():
        torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=0, atol=0)


def test_unknown_target_and_adapted_tied_head_are_refused():
    with pytest.raises(ValueError, match=r"lora.target_modules: 'q_proj' is not a layer .*valid: wq, wk"):
        build(target_modules=("q_proj",))
    with pytest.raises(ValueError, match="'output' cannot be adapted when the model ties"):
        build(dataclasses.replace(ARGS, tie_embeddings=True), target_modules=("output",))


def test_lora_config_rules():
    assert_error(["--lora.rank", "4"], "lora.rank", "lora.enable = true")
    assert_error(["--lora.enable", "--lora.target_modules", "[]"], "lora.target_modules")
    assert_error(
        ["--lora.enable", "--lora.dropout", "0.1", "--parallelism.tensor_parallel_degree", "2"],
        "lora.dropout",
        "tensor_parallel_degree",
    )
    assert_error(
        ["--lora.enable", "--lora.dropout", "0.1", "--lora.target_modules", '["wq", "output"]'],
        "lora.dropout",
        "output",
    )
    assert_error(["--lora.enable", "--lora.export_merged"], "lora.export_merged", "last_save_in_hf")
    assert_error(["--checkpoint.initial_load_adapter_path", "/x"], "initial_load_adapter_path", "lora.enable")
    assert_error(
        ["--lora.enable", "--checkpoint.initial_load_adapter_path", "/x"],
        "initial_load_adapter_path",
        "initial_load_path",
    )
    cfg = parse("--lora.enable", "--lora.rank", "16", "--lora.target_modules", '["wq", "wv"]')
    assert (cfg.lora.rank, cfg.lora.target_modules) == (16, ["wq", "wv"])
