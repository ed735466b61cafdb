"""The engine with a vision-language model in one process: images travel through packing into
the model, frozen vision towers get no gradient, and bad image inputs stop with their cause."""

import pytest
import torch

from torchtitan_rl.data.sample import Sample, SampleImage
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.models.vlm.args import vlm_flavors
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model, vision_packing

ARGS = vlm_flavors["debugmodel"]
PATCH_DIM = ARGS.vision.patch_dim


def engine(freeze_vision: bool = False, max_tokens: int = 0, max_patches: int = 0, vision: bool = True) -> Engine:
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    model = build_model(
        ARGS,
        parallel_dims=dims,
        device=torch.device("cpu"),
        seed=0,
        param_dtype=torch.float32,
        freeze_vision=freeze_vision,
    )
    optimizer = build_optimizer(model, 1e-3, 0.9, 0.95, 1e-8, 0.0)
    options = EngineOptions(
        reduction="token_mean",
        horizon=1,
        max_tokens_per_microbatch=max_tokens,
        logits_chunk_size=64,
        max_norm=0.0,
        vision=vision_packing(ARGS) if vision else None,
        max_patches_per_microbatch=max_patches,
    )
    return Engine(
        model,
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(optimizer, 10, 0, "linear", 0.0),
        parallel_dims=dims,
        device=torch.device("cpu"),
        options=options,
    )


def sample(grids: list[tuple[int, int]], seed: int, n: int = 30) -> Sample:
    gen = torch.Generator().manual_seed(seed)
    rows, at, images = torch.full((n,), -1), 2, []
    for r, c in grids:
        num = (r // 2) * (c // 2)
        rows[at : at + num] = torch.arange(num) + int((rows >= 0).sum())
        at += num + 1
        images.append(SampleImage(torch.randn(r * c, PATCH_DIM, generator=gen), r, c))
    return Sample(
        input_ids=torch.randint(0, 250, (n,), generator=gen),
        labels=torch.randint(0, 250, (n,), generator=gen),
        loss_mask=torch.arange(n) > at,
        images=images or None,
        vision_rows=rows if images else None,
    )


SAMPLES = [sample([(2, 4), (4, 4)], 0), sample([], 1), sample([(2, 2)], 2)]


def grads(e: Engine) -> dict:
    return {fqn: None if p.grad is None else p.grad.clone() for fqn, p in e.model.named_parameters()}


def test_frozen_vision_tower_gets_no_gradient_and_no_optimizer_state():
    trained, frozen = engine(), engine(freeze_vision=True)
    trained.forward_backward(SAMPLES)
    frozen.forward_backward(SAMPLES)
    got, want = grads(frozen), grads(trained)
    for fqn, g in got.items():
        if fqn.startswith("vision_tower."):
            assert g is None, fqn
        else:
            # Freezing the tower changes nothing upstream of it in this step.
            torch.testing.assert_close(g, want[fqn], rtol=0, atol=0, msg=fqn)
    assert want["vision_tower.patch_embedding.weight"].abs().sum() > 0
    optimized = {id(p) for group in frozen.optimizer.param_groups for p in group["params"]}
    assert all((id(p) in optimized) != fqn.startswith("vision_tower.") for fqn, p in frozen.model.named_parameters())


def test_micro_batch_budgets_do_not_change_the_gradient():
    whole, split = engine(), engine(max_tokens=30, max_patches=24)
    whole.forward_backward(SAMPLES)
    split.forward_backward(SAMPLES)
    for fqn, g in grads(whole).items():
        torch.testing.assert_close(grads(split)[fqn], g, rtol=1e-5, atol=1e-7, msg=fqn)


@pytest.mark.parametrize(
    "spoil, vision, message",
    [
        (lambda s: None, False, r"sample 0 of this rank's 3 has images, but the model has no vision tower"),
        (
            lambda s: s[0].vision_rows.__setitem__(2, -1),
            True,
            r"sample 0 of this rank's 3: its images give 6 feature rows, .* vision_rows has 5 image tokens",
        ),
        (
            lambda s: setattr(s[2].images[0], "rows", 3),
            True,
            r"sample 2 .* 3x2 patch grid, not a multiple of the merge size 2",
        ),
        (
            lambda s: s[2].images.__setitem__(0, SampleImage(torch.zeros(4, 5), 2, 2)),
            True,
            rf"sample 2 .* patches of shape \(4, 5\), expected \(4, {PATCH_DIM}\)",
        ),
    ],
)
def test_bad_image_inputs_name_the_sample(spoil, vision, message):
    samples = [sample([(2, 4), (4, 4)], 0), sample([], 1), sample([(2, 2)], 2)]
    spoil(samples)
    with pytest.raises(ValueError, match=message):
        engine(vision=vision).forward_backward(samples)


def test_sample_over_the_patch_budget_is_refused():
    with pytest.raises(
        ValueError, match=r"a sample of 24 vision patches exceeds training.max_patches_per_microbatch=16"
    ):
        engine(max_patches=16).forward_backward(SAMPLES)
