"""The critic's value loss against a brute-force per-token evaluation in Python floats, and its
gradient against the derivative written out by hand: V − R where the unclipped branch is the
larger, 0 where the clipped one is (its value outside the clip range does not move with V)."""

import pytest
import torch

from torchtitan_rl.losses.value import value_losses


def brute_force(v, r, old, clip):
    unclipped = 0.5 * (v - r) ** 2
    if clip == 0:
        return unclipped, False, v - r
    clipped_v = min(max(v, old - clip), old + clip)
    clipped = 0.5 * (clipped_v - r) ** 2
    if clipped > unclipped:
        return clipped, True, 0.0  # V lies outside the clip range: the clipped value is constant
    return unclipped, False, v - r


@pytest.mark.parametrize("clip", [0.0, 0.2, 1.0])
def test_value_losses_and_gradients_equal_brute_force(clip):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(64, generator=gen, dtype=torch.float64, requires_grad=True)
    returns = torch.randn(64, generator=gen, dtype=torch.float64)
    old = values.detach() + torch.randn(64, generator=gen, dtype=torch.float64) * 0.5
    weights = torch.rand(64, generator=gen, dtype=torch.float64)
    losses, was_clipped = value_losses(values, returns, old, clip)
    (losses * weights).sum().backward()
    expected = [brute_force(*map(float, t), clip) for t in zip(values.detach(), returns, old)]
    torch.testing.assert_close(losses.detach(), torch.tensor([e[0] for e in expected], dtype=torch.float64))
    assert was_clipped.tolist() == [e[1] for e in expected]
    want_grad = weights * torch.tensor([e[2] for e in expected], dtype=torch.float64)
    torch.testing.assert_close(values.grad, want_grad)
    if clip == 0.2:
        assert 0 < int(was_clipped.sum()) < 64  # both branches exercised


def test_a_negative_clip_is_a_named_error():
    with pytest.raises(ValueError, match="value clip"):
        value_losses(torch.zeros(2), torch.zeros(2), torch.zeros(2), -0.1)
