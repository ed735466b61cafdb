"""DPO on the vision-language model is exact under every layout (vlm_cases.run_vlm_dpo): with
images in some completions, a pair's two sides on different data-parallel ranks, several
micro-batches (by tokens and by vision patches) and completions without a loss token, dp 2 / 4,
tp 2, cp 2 and dp2 x cp2 give one rank's loss, ``rewards/*`` / ``logps/*`` metrics and
gradients, vision tower included. The loss's formulas against float64 brute force are
test_preference_layout.py's (the dense model); images change only what the sums are of."""

import math

import pytest

import vlm_cases as vc
from test_layout_invariance import assert_rel_close

ONE_RANK = (1, 1, 1, 1)


def runs(layout_results) -> dict:
    return {
        layout: world[vc.vlm_dpo_key(layout)]
        for world in layout_results.values()
        for layout in vc.VLM_LAYOUTS
        if vc.vlm_dpo_key(layout) in world
    }


def test_every_layout_ran_and_the_case_is_not_vacuous(layout_results):
    got = runs(layout_results)
    assert set(got) == set(vc.VLM_LAYOUTS)
    one = got[ONE_RANK]
    assert one["num_microbatches"] > 1
    # The policy is not its reference: the loss moved off log 2, and both towers get gradient.
    assert abs(one["values"]["loss_metrics/global_avg_loss"] - math.log(2)) > 1e-3
    assert one["grads"]["vision_tower.layers.0.attention.wq.weight"].abs().max() > 0
    assert one["grads"]["layers.0.attention.wq.weight"].abs().max() > 0


@pytest.mark.parametrize("layout", [layout for layout in vc.VLM_LAYOUTS if layout != ONE_RANK])
def test_vlm_dpo_gives_one_ranks_loss_metrics_and_gradients(layout_results, layout):
    got = runs(layout_results)
    one, test = got[ONE_RANK], got[layout]
    assert test["values"].keys() == one["values"].keys()
    for name, value in one["values"].items():
        assert test["values"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    for fqn, grad in one["grads"].items():
        assert_rel_close(test["grads"][fqn], grad, f"{layout} {fqn}", 1e-5)
