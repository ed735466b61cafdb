"""The proximal policy from the update's own forward (``current_proximal``, what ``rl.proximal =
"auto"`` runs when the update is the only optimizer step on its rollouts) against a separate
forward that recomputes it (proximal_cases.py): for every RL loss, with KL and entropy on, and a
token-level, a sequence-level and a geometric-mean rollout correction, the gradients, the
logged loss and grad norm, every ``rl/*`` and ``rl/rollout_corr/*`` metric and the proximal
log-probs agree within float rounding, on one rank, dp 2, cp 2 and dp2 x tp2, and each layout's
agree with one rank's separate pass. The fused update runs the model half as often.
"""

import pytest

import proximal_cases as pc
from test_layout_invariance import assert_rel_close

RTOL = 1e-5
ONE_RANK = (1, 1, 1, 1)
CASES = [(loss_fn, name) for loss_fn in pc.LOSS_FNS for name in pc.CORRECTIONS]


def runs(layout_results) -> dict:
    return {
        layout: world[pc.layout_key(*layout)]
        for world in layout_results.values()
        for layout in pc.PROXIMAL_LAYOUTS
        if pc.layout_key(*layout) in world
    }


def assert_same_run(actual: dict, expected: dict, what: str) -> None:
    for fqn, grad in expected["grads"].items():
        assert_rel_close(actual["grads"][fqn], grad, f"{what}: gradient of {fqn}", RTOL)
    assert actual["logged"].keys() == expected["logged"].keys(), what
    for tag, value in expected["logged"].items():
        # Values that are 0 one way (the ratio's log to the current policy) are float noise the other.
        assert actual["logged"][tag] == pytest.approx(value, rel=RTOL, abs=1e-6), f"{what}: {tag}"


def test_every_layout_ran(layout_results):
    assert set(runs(layout_results)) == set(pc.PROXIMAL_LAYOUTS)


@pytest.mark.parametrize("loss_fn,correction", CASES)
def test_fused_update_equals_the_separate_pass_on_every_layout(layout_results, loss_fn, correction):
    got = runs(layout_results)
    reference = got[ONE_RANK][(loss_fn, correction, "separate")]
    for layout, record in got.items():
        separate, fused = record[(loss_fn, correction, "separate")], record[(loss_fn, correction, "fused")]
        assert_same_run(fused, separate, f"{layout} fused vs separate")
        assert_same_run(fused, reference, f"{layout} fused vs one rank's separate")
        assert_same_run(separate, reference, f"{layout} separate vs one rank's")
        for a, b in zip(fused["proximal"], separate["proximal"], strict=True):
            assert (a - b).abs().max() <= 1e-5, f"{layout}: proximal log-probs"
        for a, b in zip(fused["weights"], separate["weights"], strict=True):
            assert (a - b).abs().max() <= 1e-5, f"{layout}: rollout-correction weights"
        # One model forward per micro-batch instead of two (the separate pass is gone).
        assert 0 < fused["num_forwards"] and separate["num_forwards"] == 2 * fused["num_forwards"], layout


@pytest.mark.parametrize("correction", pc.CORRECTIONS)
def test_each_correction_masks_some_tokens_and_keeps_others(layout_results, correction):
    """Premise of the comparisons: the thresholds fall inside the log-ratios, and some tags
    that are exactly 0 or 1 in the fused update really are float noise in the separate one."""
    logged = runs(layout_results)[ONE_RANK][("ppo", correction, "fused")]["logged"]
    assert 0 < logged["rl/rollout_corr/masked_fraction_token"] < 1
    assert logged["rl/rollout_corr/kl_k3"] > 1e-3  # the sampler really is another policy
    assert logged["rl/ratio_mean"] == 1.0 and logged["rl/ppo_kl"] == 0.0
