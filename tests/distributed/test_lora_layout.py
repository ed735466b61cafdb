"""LoRA is exact under every layout: with adapters on every projection and the output head and
a trainable embedding, gradients, loss, grad norm and a clipped AdamW step on dp 2, tp 2, cp 2
and dp2 x tp2 (several micro-batches per rank) equal a one-process reference that runs every
sequence alone through the plain model with each adapted weight written out as
W + alpha / r * B A; the frozen base stays bitwise unchanged, and the optimizer holds the
trainable parameters only.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import layout_cases as lc
import lora_cases as lr
from reference import minibatch_loss
from test_layout_invariance import assert_rel_close, grad_norm
from torchtitan_rl.models.qwen3.model import Qwen3Model

RTOL = 1e-5
LAYOUT_WORLDS = {
    layout: (1 if layout == (1, 1, 1, 1) else 4 if layout == (1, 2, 1, 2) else 2) for layout in lr.LORA_LAYOUTS
}


def adapted_modules() -> list[str]:
    """Every module the settings adapt, written out from the architecture (not from our code)."""
    per_layer = [f"attention.{name}" for name in ("wq", "wk", "wv", "wo")] + [
        f"feed_forward.{name}" for name in ("w1", "w2", "w3")
    ]
    return [f"layers.{i}.{name}" for i in range(lc.model_args(False).n_layers) for name in per_layer] + ["output"]


@functools.cache
def reference(mode: str):
    """(loss, {trainable name: grad}, {trainable name: initial value}, base model)."""
    model = Qwen3Model(lc.model_args(False))
    model.init_weights(lc.SEED)
    model.requires_grad_(False)
    trainable = {"tok_embeddings.weight": model.tok_embeddings.weight.detach().clone().requires_grad_()}
    for name in adapted_modules():
        out_features, in_features = model.get_submodule(name).weight.shape
        for key, shape in (
            (f"{name}.lora_a.weight", (lr.SETTINGS.rank, in_features)),
            (f"{name}.lora_b.weight", (out_features, lr.SETTINGS.rank)),
        ):
            trainable[key] = lr.adapter_values(key, shape).requires_grad_()
    scale = lr.SETTINGS.alpha / lr.SETTINGS.rank
    weights = {"tok_embeddings.weight": trainable["tok_embeddings.weight"]}
    for name in adapted_modules():
        base = model.get_submodule(name).weight
        weights[f"{name}.weight"] = (
            base + scale * trainable[f"{name}.lora_b.weight"] @ trainable[f"{name}.lora_a.weight"]
        )
    sums, counts = [], []
    for s in lc.global_batch("uneven"):
        n = len(s)
        hidden = functional_call(model, weights, (s.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long)))
        token_losses = F.cross_entropy(F.linear(hidden, weights["output.weight"]), s.labels, reduction="none")
        sums.append((token_losses * s.loss_mask.float()).sum())
        counts.append(s.loss_mask.float().sum())
    loss = minibatch_loss(sums, counts, mode, lc.HORIZON)
    grads = dict(zip(trainable, torch.autograd.grad(loss, list(trainable.values()))))
    return float(loss.detach()), grads, {k: v.detach() for k, v in trainable.items()}, model


@pytest.mark.parametrize("layout", lr.LORA_LAYOUTS, ids=lambda l: "rep{}_shard{}_cp{}_tp{}".format(*l))
@pytest.mark.parametrize("mode", [mode for mode, _ in lr.CASES])
def test_adapter_gradients_and_logged_numbers_equal_reference(layout_results, layout, mode):
    entry = layout_results[LAYOUT_WORLDS[layout]][lr.case_key(layout, mode)]
    loss, grads, _, _ = reference(mode)
    assert set(entry["grads"]) == set(grads), "only adapters and the embedding may get gradients"
    for fqn, g in grads.items():
        assert g.norm() > 0, fqn
        assert_rel_close(entry["grads"][fqn], g, f"{layout} {mode} grad {fqn}", RTOL)
    assert entry["logged"]["loss_metrics/global_avg_loss"] == pytest.approx(loss, rel=RTOL)
    assert entry["logged"]["grad_norm"] == pytest.approx(grad_norm(grads), rel=RTOL)


@pytest.mark.parametrize("layout", lr.LORA_LAYOUTS, ids=lambda l: "rep{}_shard{}_cp{}_tp{}".format(*l))
def test_clipped_adamw_step_moves_adapters_only(layout_results, layout):
    results = layout_results[LAYOUT_WORLDS[layout]]
    init, after = results[lr.case_key(layout, "init")], results[lr.case_key(layout, "token_mean")]["params"]
    _, grads, trainable, model = reference("token_mean")
    norm = grad_norm(grads)
    assert norm > lc.MAX_NORM, "the case must exercise clipping"
    params = [value.clone().requires_grad_() for value in trainable.values()]
    for param, name in zip(params, trainable):
        param.grad = grads[name] * (lc.MAX_NORM / (norm + 1e-6))
    torch.optim.AdamW(params, lr=lc.LR, betas=(0.9, 0.95), eps=lc.ADAM_EPS, weight_decay=0.1).step()
    for param, name in zip(params, trainable):
        torch.testing.assert_close(after[name], param.detach(), rtol=1e-5, atol=1e-6, msg=f"{layout} {name}")
    base = {name: p for name, p in model.named_parameters()}
    for name, value in after.items():
        if name not in trainable:
            assert torch.equal(value, init[name]), f"{layout}: frozen {name} changed"
            assert torch.equal(init[name], base[name]), f"{layout}: base {name} is not the seeded init"
    # The optimizer holds the trainable parameters only: r * (in + out) per adapted layer and
    # the embedding, nothing of the frozen base.
    expected = sum(value.numel() for value in trainable.values())
    assert results[lr.case_key(layout, "optimizer_numel")] == expected
    assert expected < sum(p.numel() for p in model.parameters())
