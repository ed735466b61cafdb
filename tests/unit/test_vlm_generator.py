"""The rollout generator with a vision-language model, single process on CPU.

Prompts are built by the data path GRPO uses (chat template, image headers, placeholders) from
PNG images of different sizes; references are the generator's no-cache mode (every step reruns
prompt, images and completion through the whole model), ``Engine.forward`` on the training
samples of the rollouts, and prompts generated one at a time.
"""

import dataclasses
import io

import pytest
import torch
from PIL import Image

from torchtitan_rl.data.chat import tokenize_prompt_row
from torchtitan_rl.data.tokenizer import ByteTokenizer
from torchtitan_rl.data.vision_samples import RowPlanner, VisionDataConfig
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.models.qwen3.args import qwen3_flavors
from torchtitan_rl.models.vlm.args import vlm_flavors
from torchtitan_rl.recipes.base import build_model, vision_packing
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator
from torchtitan_rl.rl.rollouts import ScoredGroup, to_samples
from torchtitan_rl.rl.tasks import Reward

CPU = torch.device("cpu")
ARGS = dataclasses.replace(vlm_flavors["debugmodel"], attn_backend="sdpa_dense")
VISION = VisionDataConfig(
    patch_size=ARGS.vision.patch_size,
    merge_size=ARGS.spatial_merge_size,
    max_image_tokens=16,
    max_patches_per_side=ARGS.vision.max_patches_per_side,
)
TOKENIZER = ByteTokenizer()
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.95, stop_token_ids=(TOKENIZER.im_end_id,))


def png(width: int, height: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


def prompt(question: str, *sizes: tuple[int, int], seed: int = 0):
    """(tokens, planned images) of a user turn with images of ``sizes`` (width, height)."""
    parts = [{"type": "image", "image": png(w, h, seed + k)} for k, (w, h) in enumerate(sizes)]
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": question}]}]
    planned = RowPlanner(TOKENIZER, VISION).plan_tokenized(tokenize_prompt_row(messages, TOKENIZER), 0, "test")
    return planned.tokens, planned.images


# Different image counts (0, 1, 2) and sizes (grids 2x2 .. 4x6 patches) in one batch.
PROMPTS = [
    prompt("colour?", (60, 28), seed=1),
    prompt("text only"),
    prompt("which?", (28, 28), (84, 56), seed=2),
    prompt("count?", (56, 112), seed=4),
]


def noisy_model(seed: int = 0, freeze_vision: bool = False):
    """A single-process model whose outputs depend visibly on its images."""
    dims = ParallelDims(1, 1, 1, 1, world_size=1)
    dims.build_meshes("cpu")
    model = build_model(
        ARGS, parallel_dims=dims, device=CPU, seed=seed, param_dtype=torch.float32, freeze_vision=freeze_vision
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    return model, dims


def generator_for(model, **kwargs) -> TorchGenerator:
    gen = TorchGenerator(ARGS, CPU, vision=VISION, **kwargs)
    gen.update_weights(model)
    return gen


def generate(gen: TorchGenerator, prompts=PROMPTS, indices=None, num_samples: int = 2, params=PARAMS):
    indices = list(range(len(prompts))) if indices is None else indices
    return gen.generate([t for t, _ in prompts], indices, num_samples, params, 5, 1, [i for _, i in prompts])


def test_premises_prompts_have_different_image_counts_and_grids():
    grids = [[image.grid for image in images] for _, images in PROMPTS]
    assert [len(g) for g in grids] == [1, 0, 2, 1]
    assert len({grid for g in grids for grid in g}) == 4


def test_kv_cache_decoding_equals_full_recomputation_with_images():
    model, _ = noisy_model()
    cached = generate(generator_for(model, max_prompts_per_batch=4))
    full = generate(generator_for(model, max_prompts_per_batch=4, kv_cache=False))
    assert [r.completion_tokens for r in cached] == [r.completion_tokens for r in full]
    for a, b in zip(cached, full):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert all(r.images == PROMPTS[r.prompt_index][1] for r in cached)


def test_rollouts_do_not_depend_on_the_batch_they_are_generated_in():
    model, _ = noisy_model()
    together = generate(generator_for(model, max_prompts_per_batch=4))
    alone = generator_for(model, max_prompts_per_batch=1)
    one_by_one = [r for i, p in enumerate(PROMPTS) for r in generate(alone, [p], [i])]
    assert [(r.prompt_index, r.completion_tokens) for r in together] == [
        (r.prompt_index, r.completion_tokens) for r in one_by_one
    ]


@pytest.mark.parametrize("max_prompts_per_batch", [1, 2])
def test_prompts_admitted_as_rows_finish_bring_their_images(max_prompts_per_batch):
    """All prompts in one call through a cache of 1 or 2 prompts' rows: each later prompt is
    prefilled, images and all, into rows that finished rows left, and every rollout equals its
    prompt generated alone."""
    model, _ = noisy_model()
    gen = generator_for(model, max_prompts_per_batch=max_prompts_per_batch)
    prefills = []
    prefill = gen.prefill
    gen.prefill = lambda batch, cache, prompts, first_row: (
        prefills.append((prompts, first_row)) or prefill(batch, cache, prompts, first_row)
    )
    refilled = generate(gen)
    alone = generator_for(model, max_prompts_per_batch=1)
    one_by_one = [r for i, p in enumerate(PROMPTS) for r in generate(alone, [p], [i])]
    assert [(r.prompt_index, r.sample_index, r.completion_tokens) for r in refilled] == [
        (r.prompt_index, r.sample_index, r.completion_tokens) for r in one_by_one
    ]
    for a, b in zip(refilled, one_by_one):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    # Premise: prompts with images were admitted after the first prefill, into rows others left.
    admitted_later = [p for prompts, _ in prefills[1:] for p in prompts]
    assert any(PROMPTS[p][1] for p in admitted_later)
    assert len(prefills) > 1 and prefills[0][1] == 0


def test_images_change_what_is_generated():
    """The images reach the model: the same tokens with other pixels give other log-probs."""
    model, _ = noisy_model()
    gen = generator_for(model)
    tokens, images = PROMPTS[0]
    other = prompt("colour?", (60, 28), seed=9)
    assert other[0] == tokens
    params = dataclasses.replace(PARAMS, temperature=0.0)
    a, b = (generate(gen, [p], [0], 1, params)[0] for p in ((tokens, images), other))
    assert a.logprobs[0] != pytest.approx(b.logprobs[0], abs=1e-4)


def sampler_samples(rollouts):
    groups = [
        ScoredGroup(i, [r for r in rollouts if r.prompt_index == i], [Reward(0.0, False, {})] * 2, [1.0, -1.0])
        for i in range(len(PROMPTS))
    ]
    return to_samples(groups, ARGS.max_seq_len, vision=VISION)


def test_sampler_logprobs_equal_engine_forward_on_the_training_samples():
    model, dims = noisy_model()
    rollouts = generate(generator_for(model, max_prompts_per_batch=3))
    samples = sampler_samples(rollouts)
    assert [len(s.images or ()) for s in samples] == [1, 1, 0, 0, 2, 2, 1, 1]
    options = EngineOptions(
        reduction="token_mean",
        horizon=1,
        max_tokens_per_microbatch=0,
        logits_chunk_size=16,
        max_norm=0.0,
        vision=vision_packing(ARGS),
        temperature=PARAMS.temperature,
    )
    engine = Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=CPU, options=options)
    forward = engine.forward(samples).logprobs
    for sample, rollout, logprobs in zip(samples, rollouts, forward):
        torch.testing.assert_close(logprobs[sample.loss_mask], torch.tensor(rollout.logprobs), atol=1e-5, rtol=0)


def test_weight_sync_takes_tower_and_projector_and_skips_a_frozen_tower():
    model, _ = noisy_model(freeze_vision=True)
    gen = TorchGenerator(ARGS, CPU, vision=VISION, freeze_vision=True)
    first = {name for name, _ in gen.next_sync()}
    assert any(n.startswith("vision_tower.") for n in first) and any(n.startswith("projector.") for n in first)
    gen.update_weights(model)
    for name, param in gen.model.named_parameters():
        torch.testing.assert_close(param, dict(model.named_parameters())[name], rtol=0, atol=0)
    later = {name for name, _ in gen.next_sync()}
    assert not any(n.startswith("vision_tower.") for n in later)
    assert any(n.startswith("projector.") for n in later)
    unfrozen = TorchGenerator(ARGS, CPU, vision=VISION)
    unfrozen.update_weights(noisy_model()[0])
    assert any(n.startswith("vision_tower.") for n, _ in unfrozen.next_sync())


def test_prompt_images_need_a_vision_model():
    with pytest.raises(ValueError, match="takes no images"):
        TorchGenerator(qwen3_flavors["debugmodel"], CPU, vision=VISION)
    text = TorchGenerator(qwen3_flavors["debugmodel"], CPU)
    text.update_weights(
        build_model(
            qwen3_flavors["debugmodel"], parallel_dims=noisy_model()[1], device=CPU, seed=0, param_dtype=torch.float32
        )
    )
    with pytest.raises(ValueError, match="need a vision-language model"):
        generate(text, PROMPTS[:1])


def test_phase_seconds_split_prefill_from_decoding_and_reset():
    gen = generator_for(noisy_model()[0])
    gen.take_phase_seconds()
    generate(gen, PROMPTS[:1], num_samples=1, params=dataclasses.replace(PARAMS, stop_token_ids=()))
    phases = gen.take_phase_seconds()
    assert phases["prefill"] > 0 and phases["decode"] > 0
    assert gen.take_phase_seconds() == {"prefill": 0.0, "decode": 0.0}
