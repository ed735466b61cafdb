"""AdamW implementations (optim.build_optimizer): fused and foreach against AdamW written out."""

import math

import pytest
import torch
from torch import nn

from torchtitan_rl.config.manager import ConfigManager
from torchtitan_rl.optim import build_optimizer

LR, BETA1, BETA2, EPS, WD = 1e-2, 0.9, 0.95, 1e-8, 0.1
STEPS = 5


def adamw_by_hand(params: list[torch.Tensor], grads_per_step: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Decoupled weight decay, bias-corrected moments (Loshchilov & Hutter), in float64."""
    params = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.double()
            params[i] *= 1 - LR * WD
            m[i] = BETA1 * m[i] + (1 - BETA1) * g
            v[i] = BETA2 * v[i] + (1 - BETA2) * g * g
            m_hat, v_hat = m[i] / (1 - BETA1**t), v[i] / (1 - BETA2**t)
            params[i] -= LR * m_hat / (v_hat.sqrt() + EPS)
    return params


def run(implementation: str, model: nn.Module, grads_per_step) -> list[torch.Tensor]:
    optimizer = build_optimizer(model, LR, BETA1, BETA2, EPS, WD, implementation)
    for grads in grads_per_step:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def fresh_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8, bias=False))


@pytest.mark.parametrize("implementation", ["auto", "fused", "foreach"])
def test_every_implementation_is_adamw(implementation):
    """Five steps of each implementation equal AdamW written out (float rounding only), and
    fused (auto) stays within float rounding of foreach."""
    gen = torch.Generator().manual_seed(1)
    initial = [p.detach().clone() for p in fresh_model().parameters()]
    grads_per_step = [[torch.randn(p.shape, generator=gen) for p in initial] for _ in range(STEPS)]
    expected = adamw_by_hand(initial, grads_per_step)
    got = run(implementation, fresh_model(), grads_per_step)
    foreach = run("foreach", fresh_model(), grads_per_step)
    for g, e, f in zip(got, expected, foreach):
        scale = float(e.abs().max())
        assert float((g.double() - e).abs().max()) <= 1e-6 * scale
        # A step moves each weight by about lr: float32 rounding of a few steps is far below it.
        assert float((g - f).abs().max()) <= 1e-6 * max(scale, LR * STEPS)
    assert not math.isclose(float(got[0].sum()), float(initial[0].sum()))  # the steps moved the weights


def test_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="optimizer.implementation: 'adam8bit'"):
        build_optimizer(fresh_model(), LR, BETA1, BETA2, EPS, WD, "adam8bit")


def test_implementation_setting():
    assert ConfigManager().parse_args([]).optimizer.implementation == "auto"
    assert ConfigManager().parse_args(["--optimizer.implementation", "foreach"]).optimizer.implementation == "foreach"
    with pytest.raises(ValueError, match="optimizer.implementation"):
        ConfigManager().parse_args(["--optimizer.implementation", "for-loop"])
