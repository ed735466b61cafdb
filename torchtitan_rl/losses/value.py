"""The critic's value loss of PPO with a learned value function, per token.

``ℓ_t = ½ (V_t − R_t)²`` against the GAE return R_t (``rl.gae``). With a clip c > 0 the loss is
the larger of that and ``½ (clip(V_t, V^old_t − c, V^old_t + c) − R_t)²``, V^old the values the
returns were computed from: the pessimistic choice of PPO's value clipping (verl's
``clip_ratio_value``), which stops a token's value moving more than c from where it was unless
that brings it closer to its return. Like every loss here it is reduced as ``Σ_t w_t ℓ_t`` with
the reduction mode's weights from global counts (``losses.reduction``), so it is exact under
every layout and accumulation.
"""

import torch


def value_losses(
    values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor | None, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ℓ_t, clipped_t)`` per token: the value loss and whether the clipped branch is the larger
    (the token's gradient is then 0: ``critic/vf_clipfrac``). ``clip`` 0 is no clipping."""
    if clip < 0:
        raise ValueError(f"the value clip must be >= 0, got {clip}")
    unclipped = 0.5 * (values - returns) ** 2
    if clip == 0:
        return unclipped, torch.zeros_like(values, dtype=torch.bool)
    assert old_values is not None, "value clipping needs the old values"
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = 0.5 * (clipped_values - returns) ** 2
    # Inside the clip range old + (V − old) is V up to rounding: only a value outside it can be
    # held, or the choice (and clipfrac) would follow last-bit noise that differs by layout.
    held = ((values - old_values).abs() > clip) & (clipped > unclipped)
    return torch.where(held, clipped, unclipped), held
