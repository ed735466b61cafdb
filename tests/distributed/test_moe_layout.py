"""Router losses are exact for any layout: with the load-balancing loss (global and sequence
scopes, pooled and summed over layers; the micro-batch scope for a fixed micro-batch plan)
and the z-loss on, gradients (router and experts; with LoRA on attention and the dense MLP,
the adapters'),
grad norm and the logged moe/aux_loss and moe/z_loss on dp 2, cp 2, tp 2, dp2 x cp2 and
cp2 x tp2, with several micro-batches per rank and a filler micro-batch, equal a one-process
reference that runs every sequence alone and writes the losses out by hand.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import layout_cases as lc
import lora_cases
import moe_cases as mc
from test_layout_invariance import assert_rel_close, grad_norm, greedy_plan
from torchtitan_rl.models.qwen3.model import Qwen3Model

RTOL = 1e-5


def reference_model() -> Qwen3Model:
    model = Qwen3Model(mc.model_args())
    model.init_weights(lc.SEED)
    mc.set_router_weights(model)
    return model


def balance(counts: torch.Tensor, prob_sums: torch.Tensor, num_tokens: int, layers: str) -> torch.Tensor:
    """E * sum_e f_e * P_e of one group from its [L, E] counts and probability sums."""
    num_layers, num_experts = counts.shape
    if layers == "pooled":
        return (
            num_experts
            * (counts.sum(0) / (num_layers * num_tokens) * prob_sums.sum(0) / (num_layers * num_tokens)).sum()
        )
    return num_experts * sum((counts[l] / num_tokens * prob_sums[l] / num_tokens).sum() for l in range(num_layers))


@functools.cache
def reference(name: str):
    config = {mc.AUX_ONLY: mc.AUX_ONLY_CONFIG, mc.MICROBATCH: mc.MICROBATCH_CONFIG}.get(name) or mc.ROUTER_CONFIGS.get(
        name
    )
    if name == mc.LORA:
        config = mc.ROUTER_CONFIGS["global_pooled"]
    variant = "no_loss" if name == mc.AUX_ONLY else "uneven"
    model = reference_model()
    forward, leaves = model, dict(model.named_parameters())
    if name == mc.LORA:
        forward, leaves = lora_forward(model)
    ce, masks, stats = [], [], []
    for s in lc.global_batch(variant):
        n = len(s)
        hidden, router = forward(s.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long))
        ce.append(F.cross_entropy(model.output(hidden), s.labels, reduction="none"))
        masks.append(s.loss_mask.float())
        stats.append(router)
    num_loss = sum(m.sum() for m in masks)
    token_loss = sum((c * m).sum() for c, m in zip(ce, masks)) / num_loss.clamp(min=1)
    num_tokens = sum(len(s) for s in lc.global_batch(variant))
    counts = [st.counts[:, 0] for st in stats]  # [L, E] of each sequence (alone: one sequence)
    probs = [st.prob_sums[:, 0] for st in stats]
    lengths = [len(s) for s in lc.global_batch(variant)]
    if config.aux_loss_scope == "global":
        aux = balance(sum(counts), sum(probs), num_tokens, config.aux_loss_layers)
    elif config.aux_loss_scope == "microbatch":
        groups = greedy_plan(lengths, mc.BUDGET)  # one rank: the plan of the whole batch
        aux = sum(
            balance(
                sum(counts[i] for i in g), sum(probs[i] for i in g), sum(lengths[i] for i in g), config.aux_loss_layers
            )
            for g in groups
        ) / len(groups)
    else:
        aux = sum(
            balance(c, p, len(s), config.aux_loss_layers) for c, p, s in zip(counts, probs, lc.global_batch(variant))
        ) / len(stats)
    z = sum(st.z_sums.sum() for st in stats) / num_tokens
    loss = token_loss + config.aux_loss_coef * aux + config.z_loss_coef * z
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    return grads, float(token_loss.detach()), float(aux.detach()), float(z.detach()), config


def lora_forward(model):
    """The model's forward with every adapted weight written out as W + alpha / r * B A, and the
    adapters (the only tensors that train) by name. The adapted layers are listed from the
    architecture: the attention projections of every layer, the dense MLP of layer 0."""
    settings = mc.LORA_SETTINGS
    adapted = [f"layers.{i}.attention.{w}" for i in range(mc.model_args().n_layers) for w in ("wq", "wo")]
    adapted += [f"layers.0.feed_forward.{w}" for w in ("w1", "w2")]
    model.requires_grad_(False)
    leaves, weights = {}, {}
    for module in adapted:
        out_features, in_features = model.get_submodule(module).weight.shape
        a, b = f"{module}.lora_a.weight", f"{module}.lora_b.weight"
        leaves[a] = lora_cases.adapter_values(a, (settings.rank, in_features)).requires_grad_()
        leaves[b] = lora_cases.adapter_values(b, (out_features, settings.rank)).requires_grad_()
        base = model.get_submodule(module).weight
        weights[f"{module}.weight"] = base + settings.alpha / settings.rank * leaves[b] @ leaves[a]
    return (lambda *args: functional_call(model, weights, args)), leaves


def moe_entries(results):
    return {key: entry for world in results.values() for key, entry in world.items() if key.startswith("moe/")}


def test_every_moe_layout_and_case_was_run(layout_results):
    names = [*mc.ROUTER_CONFIGS, mc.AUX_ONLY, mc.LORA]
    expected = {mc.case_key(layout, name) for layout in mc.MOE_LAYOUTS for name in names}
    expected |= {mc.case_key(layout, mc.MICROBATCH) for layout in mc.MOE_LAYOUTS if layout[0] * layout[1] == 1}
    assert set(moe_entries(layout_results)) == expected


def test_router_losses_and_gradients_equal_the_one_process_reference(layout_results):
    for key, entry in moe_entries(layout_results).items():
        grads, token_loss, aux, z, config = reference(key.split("/")[-1])
        for fqn, g in grads.items():
            assert_rel_close(entry["grads"][fqn], g, f"{key} grad {fqn}")
        logged = entry["logged"]
        assert logged["grad_norm"] == pytest.approx(grad_norm(grads), rel=RTOL), key
        assert logged["loss_metrics/global_avg_loss"] == pytest.approx(token_loss, rel=RTOL, abs=1e-12), key
        assert logged["moe/aux_loss"] == pytest.approx(aux, rel=RTOL), key
        if config.z_loss_coef > 0:
            assert logged["moe/z_loss"] == pytest.approx(z, rel=RTOL), key
        else:
            assert "moe/z_loss" not in logged
        for layer in mc.model_args().moe_layers:
            assert logged[f"moe/load_imbalance/layer_{layer}"] >= 1.0


def test_aux_only_gradient_norm_does_not_scale_with_cp_or_tp(layout_results):
    """A token count pre-multiplied under CP (a bug another framework shipped) left the router
    losses' gradient norm 10^4 times too large. The aux-only objective's norm is the same on 1 rank, cp 2 and tp 2."""
    norms = {
        layout: moe_entries(layout_results)[mc.case_key(layout, mc.AUX_ONLY)]["logged"]["grad_norm"]
        for layout in ((1, 1, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2), (1, 1, 2, 2))
    }
    grads, *_ = reference(mc.AUX_ONLY)
    assert grad_norm(grads) > 0
    for layout, norm in norms.items():
        assert norm == pytest.approx(grad_norm(grads), rel=RTOL), layout


def test_moe_cases_route_unevenly_and_split_into_several_microbatches(layout_results):
    """The premises: the router is far from uniform (so balancing has work to do), and the
    budget gives 3 micro-batches on one rank, 2 and 1 on the ranks of dp 2 (a filler)."""
    logged = layout_results[1][mc.case_key((1, 1, 1, 1), "global_pooled")]["logged"]
    assert max(logged[f"moe/load_imbalance/layer_{layer}"] for layer in mc.model_args().moe_layers) > 1.1
    lengths = [len(s) for s in lc.global_batch("uneven")]
    assert len(greedy_plan(lengths, mc.BUDGET)) == 3
    assert [len(greedy_plan(lengths[:4], mc.BUDGET)), len(greedy_plan(lengths[4:], mc.BUDGET))] == [2, 1]
