"""The promise for vision-language training: gradients, logged loss, grad norm and the clipped
AdamW step do not depend on the layout (dp 1/2/4, tp 2, cp 2, dp2 x cp2), the micro-batch
budgets (tokens and vision patches) or DP compute balancing.

The reference runs every sample alone, unpacked, through the VLM in one process (its images
through the vision tower on their own) and applies the reduction formulas of docs/design.md ('Loss weights').
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import layout_cases as lc
import vlm_cases as vc
from reference import minibatch_loss
from test_layout_invariance import assert_rel_close, grad_norm
from torchtitan_rl.models.vlm.model import VisionInputs, VLMModel

RTOL = 1e-5


def reference_model() -> VLMModel:
    model = VLMModel(vc.model_args())
    model.init_weights(lc.SEED)
    return model


def per_sample_losses(model: VLMModel) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in vc.global_batch():
        n = len(s)
        vision = None
        if s.images:
            patches = torch.cat([image.patches for image in s.images])
            vision = VisionInputs(patches, tuple((image.rows, image.cols) for image in s.images), s.vision_rows)
        hidden = model(s.input_ids, torch.arange(n), torch.zeros(n, dtype=torch.long), vision=vision)
        out.append((F.cross_entropy(model.output(hidden), s.labels, reduction="none"), s.loss_mask.float()))
    return out


@functools.cache
def reference(mode: str):
    model = reference_model()
    seqs = per_sample_losses(model)
    loss = minibatch_loss([(l * m).sum() for l, m in seqs], [m.sum() for _, m in seqs], mode, lc.HORIZON)
    loss.backward()
    grads = {fqn: p.grad.clone() for fqn, p in model.named_parameters()}
    return float(loss.detach()), grads, int(sum(m.sum() for _, m in seqs))


def vlm_entries(results):
    return {key: entry for world in results.values() for key, entry in world.items() if key.startswith("vlm/")}


def test_every_vlm_layout_mode_budget_and_balancing_was_run(layout_results):
    got = set(vlm_entries(layout_results))
    expected = {
        vc.case_key(layout, mode, budget, balance)
        for layout in vc.VLM_LAYOUTS
        for mode in vc.MODES
        for budget in vc.BUDGETS
        for balance in (False, True)
    }
    expected |= {vc.case_key(layout, "token_mean", vc.BUDGETS[1], True, step=True) for layout in vc.VLM_LAYOUTS}
    assert got == expected


def test_vlm_gradients_and_logged_metrics_equal_the_per_sample_reference(layout_results):
    for key, entry in vlm_entries(layout_results).items():
        mode = key.split("/")[2]
        loss, grads, loss_tokens = reference(mode)
        for fqn, g in grads.items():
            assert_rel_close(entry["grads"][fqn], g, f"{key} grad {fqn}")
        logged = entry["logged"]
        assert logged["loss_metrics/global_avg_loss"] == pytest.approx(loss, rel=RTOL), key
        assert logged["grad_norm"] == pytest.approx(grad_norm(grads), rel=RTOL), key
        assert logged["tokens/loss_tokens"] == loss_tokens, key
        assert logged["tokens/total"] == sum(len(s) for s in vc.global_batch()), key


def test_vlm_clipped_adamw_step_equals_reference(layout_results):
    _, grads, _ = reference("token_mean")
    norm = grad_norm(grads)
    assert norm > lc.MAX_NORM, "the case must exercise clipping"
    model = reference_model()
    for fqn, p in model.named_parameters():
        p.grad = grads[fqn] * (lc.MAX_NORM / (norm + 1e-6))
    torch.optim.AdamW(model.parameters(), lr=lc.LR, betas=(0.9, 0.95), eps=lc.ADAM_EPS, weight_decay=0.1).step()
    steps = {key: e for key, e in vlm_entries(layout_results).items() if key.endswith("/step")}
    assert len(steps) == len(vc.VLM_LAYOUTS)
    for key, entry in steps.items():
        for fqn, p in model.named_parameters():
            torch.testing.assert_close(entry["params"][fqn], p.detach(), rtol=1e-5, atol=1e-6, msg=f"{key} {fqn}")


def test_vlm_data_premises():
    """What makes the cases above hard: a DP rank with no image in the whole step, an image
    straddling a CP chunk, samples without loss tokens, a vision tower that really learns,
    and a balanced assignment that differs from the contiguous one."""
    samples = vc.global_batch()
    assert [bool(s.images) for s in samples[4:]] == [False] * 4  # rank 1 of dp = 2: no image
    assert sum(s.num_loss_tokens == 0 for s in samples) == 2
    image_rows = (samples[1].vision_rows >= 0).nonzero()[:, 0]
    chunk = 16 // 4  # cp = 2: sample 1's 16 tokens in 4 chunks
    assert image_rows.min() < chunk <= image_rows.max()
    _, grads, _ = reference("token_mean")
    for prefix in ("vision_tower.", "projector."):
        assert all(g.abs().sum() > 0 for fqn, g in grads.items() if fqn.startswith(prefix)), prefix
    for max_tokens, max_patches in vc.BUDGETS:
        assignment = vc.assign_to_ranks(
            [len(s) for s in samples],
            2,
            num_patches=[s.num_patches for s in samples],
            max_tokens=max_tokens,
            max_patches=max_patches,
        )
        assert assignment != [[0, 1, 2, 3], [4, 5, 6, 7]], (max_tokens, max_patches)


def test_vlm_layouts_include_a_rank_without_images(layout_results):
    entry = layout_results[2][vc.case_key((1, 2, 1, 1), "token_mean", vc.BUDGETS[1], False)]
    assert 0 in entry["images_per_rank"]
