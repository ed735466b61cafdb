"""The data-parallel cost model of a model (``recipes.base.balance_cost_model``) against FLOPs
counted by hand from the model itself: its weight matrices, built on the meta device (no memory),
and the attention arithmetic of its widths."""

from pathlib import Path

import pytest
import torch
from torch import nn

from torchtitan_rl.config import ConfigManager
from torchtitan_rl.data.balance import DEFAULT_COST_MODEL, CostModel
from torchtitan_rl.models.moe import GroupedExperts, TopKRouter
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.models.registry import get_model_spec
from torchtitan_rl.models.vlm.args import vlm_flavors
from torchtitan_rl.recipes.base import balance_cost_model
from torchtitan_rl.recipes.sft import SFTRecipe


def meta_model(family: str, args) -> nn.Module:
    with torch.device("meta"):
        return get_model_spec(family).model_cls(args)


def multiply_adds_per_token(module: nn.Module, top_k: int = 0) -> float:
    """Multiply-adds of one token through ``module``'s weight matrices: every linear layer (and
    router) whole, an expert bank's ``top_k`` experts of its ``E``."""
    total = 0.0
    for m in module.modules():
        if isinstance(m, (nn.Linear, TopKRouter)):
            total += m.weight.numel()
        elif isinstance(m, GroupedExperts):
            total += sum(p.numel() for p in m.parameters()) * top_k / m.w1.shape[0]
    return total


def sequence_flops(args, linear_flops: float, num_tokens: int) -> float:
    """Forward FLOPs of a causal sequence: each token through the linear layers, and per layer,
    head and (query, key) pair with key <= query, q.k and the value's weighted add (head_dim
    multiply-adds each)."""
    num_pairs = num_tokens * (num_tokens + 1) / 2
    return num_tokens * linear_flops + num_pairs * args.n_layers * args.n_heads * 2 * (2 * args.head_dim)


@pytest.mark.parametrize("flavor", ["0.6B", "8B", "30B-A3B"])
def test_a_sample_costs_its_flops_in_units_of_one_token_through_the_linear_layers(flavor):
    args = qwen3_flavors[flavor]
    linear_flops = 2 * multiply_adds_per_token(meta_model("qwen3", args), args.num_experts_per_tok)
    cost_model = balance_cost_model(args)
    for num_tokens in (512, 8192, 32768):
        by_hand = sequence_flops(args, linear_flops, num_tokens) / linear_flops
        # The model leaves out the t / 2 of the diagonal pairs: relative 1 / t of the quadratic term.
        assert cost_model.sample_cost(num_tokens) == pytest.approx(by_hand, rel=1e-3), num_tokens


def test_attention_weighs_less_the_wider_the_linear_layers():
    small, large = (balance_cost_model(qwen3_flavors[f]).quadratic_tokens for f in ("0.6B", "8B"))
    # Qwen3-0.6B: 596M weights a token goes through (the 156M output head included) against
    # 28 layers x 16 heads x 128 of attention; 8B: 7.57G against 36 x 32 x 128.
    assert small == pytest.approx(2 * 2 * 596.0e6 / (28 * 16 * 128 * 4), rel=1e-2)
    assert large == pytest.approx(2 * 2 * 7.57e9 / (36 * 32 * 128 * 4), rel=1e-2)
    assert large > 4 * small


def test_a_vision_patch_costs_the_encoder_and_its_share_of_the_projector():
    args = vlm_flavors["0.6B"]
    model = meta_model("vlm", args)
    vision, projector = model.vision_tower, model.projector
    text = multiply_adds_per_token(model) - multiply_adds_per_token(vision) - multiply_adds_per_token(projector)
    # Every patch goes through the encoder (patch embedding included); merge x merge patches
    # share one merged token through the projector.
    per_patch = multiply_adds_per_token(vision) + vision.patch_embedding.weight.numel()
    per_patch += multiply_adds_per_token(projector) / args.spatial_merge_size**2
    cost_model = balance_cost_model(args)
    assert cost_model.per_patch == pytest.approx(per_patch / text, rel=1e-9)
    assert cost_model.quadratic_tokens == pytest.approx(balance_cost_model(qwen3_flavors["0.6B"]).quadratic_tokens)
    assert 0.1 < cost_model.per_patch < 1  # a ~0.3B encoder next to a ~0.6B language model


def test_flops_that_are_not_positive_are_refused():
    with pytest.raises(ValueError, match="FLOPs must be positive"):
        CostModel.from_flops(0, 1)


def test_the_sft_recipe_balances_by_its_model_s_cost(tmp_path):
    configs = Path(__file__).resolve().parents[2] / "train_configs"
    args = ["--job.config_file", str(configs / "debug_model.toml"), "--job.dump_folder", str(tmp_path)]
    args += ["--training.global_batch_size", "4", "--training.seq_len", "64", "--metrics.enable_tensorboard", "false"]
    recipe = SFTRecipe(ConfigManager().parse_args(args))
    expected = balance_cost_model(recipe.model_args)
    assert recipe.engine.options.cost_model == expected  # micro-batch plans
    assert recipe.dataloader.dataset.cost_model == expected  # the split over data-parallel ranks
    assert expected.quadratic_tokens != DEFAULT_COST_MODEL.quadratic_tokens  # not the generic one
    recipe.close()
