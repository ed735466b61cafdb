"""Whole GRPO steps of the vision-language model do not depend on the layout: the rollouts
(generated from prompts with images) are bitwise those of one rank, every mini-batch trains the
same samples with the same images, and the logged loss, KL, entropy, grad norm and the weights
after each clipped AdamW step equal one rank's (dp 2, cp 2, dp2 x tp2; vlm_grpo_cases.py).

The premises the layouts must meet are asserted too: a data-parallel rank trains a mini-batch
without any image, an image's placeholders straddle a context-parallel chunk boundary, and
the steps are not trivial (rewards differ within groups, the weights move, KL is positive).
"""

import pytest
import torch

import vlm_grpo_cases as vg
from test_layout_invariance import assert_rel_close
from torchtitan_rl.distributed.context_parallel import ZigzagLayout

RTOL = 1e-5
ONE_RANK = (1, 1, 1, 1)


def runs(layout_results) -> dict:
    return {
        layout: world[vg.layout_key(*layout)]
        for world in layout_results.values()
        for layout in vg.VLM_GRPO_LAYOUTS
        if vg.layout_key(*layout) in world
    }


def rollouts(step: dict) -> list[tuple]:
    """Every rollout of the step once (TP / CP peers split the generation; DP ranks own slots)."""
    return sorted(
        {
            (p, s): (p, s, tokens, logprobs, images)
            for rank in step["ranks"]
            for p, s, tokens, logprobs, images in rank["rollouts"]
        }.values()
    )


def trained(step: dict, minibatch: int, layout: tuple) -> list[tuple]:
    """The mini-batch's samples over the data-parallel ranks (peers hold copies), in a fixed order."""
    num_peers = layout[2] * layout[3]
    samples = [s for rank in step["ranks"][::num_peers] for s in rank["trained"][minibatch]]
    return sorted(samples, key=lambda s: (s[0], s[1]))


def test_every_layout_ran(layout_results):
    assert set(runs(layout_results)) == set(vg.VLM_GRPO_LAYOUTS)


def test_rollouts_are_bitwise_those_of_one_rank(layout_results):
    """Bitwise at step 1 (the same initial weights everywhere); at step 2 the weights differ by
    the layouts' float summation order, so the log-probs may differ in the last bits."""
    got = runs(layout_results)
    for layout, steps in got.items():
        first, ref = rollouts(steps[0]), rollouts(got[ONE_RANK][0])
        assert first == ref, layout
        second, ref = rollouts(steps[1]), rollouts(got[ONE_RANK][1])
        assert [(p, s, t, i) for p, s, t, _, i in second] == [(p, s, t, i) for p, s, t, _, i in ref], layout
        for a, b in zip(second, ref):
            assert a[3] == pytest.approx(b[3], abs=1e-5), layout


def test_every_minibatch_trains_the_same_samples_with_their_images(layout_results):
    got = runs(layout_results)
    for layout, steps in got.items():
        for step, (mine, ref) in enumerate(zip(steps, got[ONE_RANK])):
            for m in range(vg.NUM_MINIBATCHES):
                a, b = trained(mine, m, layout), trained(ref, m, ONE_RANK)
                assert [(s[0], s[1]) for s in a] == [(s[0], s[1]) for s in b], (layout, step, m)
                for x, y in zip(a, b):
                    assert len(x[2]) == len(y[2]) and all(torch.equal(p, q) for p, q in zip(x[2], y[2]))
                    assert (x[3] is None) == (y[3] is None) and (x[3] is None or torch.equal(x[3], y[3]))


def test_logged_numbers_and_stepped_weights_equal_one_rank(layout_results):
    got = runs(layout_results)
    for layout, steps in got.items():
        for step, (mine, ref) in enumerate(zip(steps, got[ONE_RANK])):
            for fqn, value in ref["params"].items():
                assert_rel_close(mine["params"][fqn], value, f"{layout} step {step} {fqn}")
            for m, (a, b) in enumerate(zip(mine["logged"], ref["logged"])):
                assert set(a) == set(b) and {"rl/kl", "rl/entropy"} <= set(a), (layout, step, m)
                for tag, value in b.items():
                    assert a[tag] == pytest.approx(value, rel=RTOL, abs=1e-7), (layout, step, m, tag)


def test_premise_a_data_parallel_rank_trains_a_minibatch_without_images(layout_results):
    """At step 1 one dp 2 rank trains a mini-batch with no image while the other has some; at
    step 2 (balanced) samples with images move to the other rank."""
    dp2 = runs(layout_results)[(1, 2, 1, 1)]
    counts = [[[len(s[2]) for s in mb] for mb in rank["trained"]] for rank in dp2[0]["ranks"]]
    assert any(sum(counts[0][m]) > 0 and sum(counts[1][m]) == 0 for m in range(vg.NUM_MINIBATCHES)), counts
    own = {s[0] for rank in dp2[0]["ranks"][1:] for mb in rank["trained"] for s in mb}
    moved = {s[0] for rank in dp2[1]["ranks"][1:] for mb in rank["trained"] for s in mb if s[2]}
    assert moved - own, (own, moved)


def test_premise_an_image_straddles_a_context_parallel_chunk_boundary(layout_results):
    """Some trained sample has an image whose feature rows the two CP ranks share between them."""
    cp2 = runs(layout_results)[(1, 1, 2, 1)]
    straddling = 0
    for step in cp2:
        for mb in step["ranks"][0]["trained"]:
            for _, input_ids, patches, vision_rows in mb:
                if not patches:
                    continue
                # Feature rows of the first image: its patches merged 2 x 2.
                first = (vision_rows >= 0) & (vision_rows < patches[0].shape[0] // 4)
                positions = set(first.nonzero().flatten().tolist())
                layout = ZigzagLayout.build([len(input_ids)], 2)
                held = [set(layout.split(torch.arange(len(input_ids)), r, -1).tolist()) for r in range(2)]
                straddling += all(held[r] & positions for r in range(2))
    assert straddling > 0


def test_premise_the_steps_are_not_trivial(layout_results):
    ref = runs(layout_results)[ONE_RANK]
    rewards = {}
    for p, _, tokens, _, _ in rollouts(ref[0]):
        rewards.setdefault(p, set()).add(sum(tokens) % 2)
    assert sum(len(r) > 1 for r in rewards.values()) >= 2, rewards
    moved = [float((ref[1]["params"][f] - ref[0]["params"][f]).abs().max()) for f in ref[0]["params"]]
    assert min(moved) > 0
    assert ref[1]["logged"][0]["rl/kl"] > 0
    assert any(len(images) == 2 for _, _, _, _, images in rollouts(ref[0]))
