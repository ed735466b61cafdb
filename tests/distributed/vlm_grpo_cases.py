"""Whole GRPO steps of a vision-language model inside the shared multi-rank launch
(``layout_worker.run_all_layouts``).

On the layouts of ``VLM_GRPO_LAYOUTS`` (one rank, dp 2, cp 2, dp2 x tp2) the tiny VLM of
``vlm_cases`` runs two GRPO steps the way the GRPO recipe does: refresh the generator's replica,
generate this rank's share of the step's prompts (PNG images of different sizes, 0 to 2 per
prompt), exchange with the CP / TP peers, reward and score the groups, turn them into samples
that carry their images, balance them over the data-parallel ranks, recompute the reference's
and the proximal policy's log-probs, then one clipped AdamW step per mini-batch with the PPO
loss, KL and entropy on. The first step trains each rank's own
share of the prompts, the second balances the samples. Rank 0 records every rank's rollouts, the samples each rank trained
(images included), the logged numbers and the parameters after each step for
test_vlm_grpo_layout.py. Kept free of any reference computation.
"""

import io

import torch
import torch.distributed as dist
from PIL import Image

import layout_cases as lc
import vlm_cases as vc
from rl_cases import gather_to_all
from torchtitan_rl.data.images import image_grid, image_placeholder
from torchtitan_rl.data.packing import VisionPacking
from torchtitan_rl.data.tokenizer import ImageTokenIds
from torchtitan_rl.data.vision_samples import PlannedImage, VisionDataConfig
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.generator import SamplingParams, TorchGenerator
from torchtitan_rl.rl.rollouts import (
    balance_over_data_parallel,
    exchange_among_peers,
    generate_share,
    rank_prompt_slots,
    score_groups,
    to_samples,
)
from torchtitan_rl.rl.tasks import Reward

VLM_GRPO_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 2, 1, 2))
NUM_STEPS, NUM_MINIBATCHES, GROUP_SIZE = 2, 2, 3
# One prompt per generation batch: the same batches on every layout, so rollouts are bitwise
# those of one process.
MAX_PROMPTS_PER_BATCH = 1
PARAMS = SamplingParams(max_new_tokens=5, temperature=0.9, stop_token_ids=(0,))
SEED = 13
LOSS_OPTIONS = {
    "clip_low": 0.2,
    "clip_high": 0.28,
    "kl_coef": 0.3,
    "kl_estimator": "k3",
    "entropy_coef": 0.1,
    "proximal_logprobs": True,
}
MODE = "sequence_mean"
VISION = VisionDataConfig(
    patch_size=vc.model_args().vision.patch_size,
    merge_size=vc.MERGE,
    max_image_tokens=64,
    max_patches_per_side=vc.model_args().vision.max_patches_per_side,
)
IDS = ImageTokenIds(vc.IMAGE_ID, vc.BREAK_ID, vc.END_ID)
# Per prompt of the step: (text tokens before the images, image sizes (width, height) in pixels).
# Prompts 2, 3, 6 and 7 have no image: with dp 2 each mini-batch's second half is text only,
# so a rank holds no image until balancing moves samples. Prompt 0's image (two rows of
# placeholders from token 3 on) straddles the first chunk boundary of cp 2.
PROMPT_SPECS = (
    (3, [(16, 8)]),
    (1, [(8, 8), (12, 4)]),
    (6, []),
    (2, []),
    (2, [(4, 16)]),
    (4, [(8, 12)]),
    (5, []),
    (3, []),
)


def png(width: int, height: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


def step_prompts() -> tuple[list[list[int]], list[tuple[PlannedImage, ...]]]:
    """The step's prompt tokens (text, then each image's placeholders, then one text token)
    and their planned images."""
    gen = torch.Generator().manual_seed(21)
    prompts, images = [], []
    for k, (num_text, sizes) in enumerate(PROMPT_SPECS):
        tokens = torch.randint(1, vc.IMAGE_ID, (num_text,), generator=gen).tolist()
        planned = []
        for j, (width, height) in enumerate(sizes):
            grid = image_grid(height, width, VISION.patch_size, VISION.merge_size, VISION.max_image_tokens)
            placeholder = image_placeholder(grid, VISION.merge_size, IDS)
            planned.append(
                PlannedImage(
                    png(width, height, 100 * k + j), f"prompt {k} image {j}", grid, len(tokens), len(placeholder)
                )
            )
            tokens += placeholder
        prompts.append(tokens + torch.randint(1, vc.IMAGE_ID, (1,), generator=gen).tolist())
        images.append(tuple(planned))
    return prompts, images


def reward(rollout) -> Reward:
    """Differs within most groups: the parity of the completion's token sum."""
    return Reward(float(sum(rollout.completion_tokens) % 2), False, {})


def layout_key(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    return f"vlm_grpo/rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}"


def _engine(model, dims: ParallelDims, optimizer=None, scheduler=None) -> Engine:
    options = EngineOptions(
        reduction=MODE,
        horizon=lc.HORIZON,
        max_tokens_per_microbatch=40,
        logits_chunk_size=16,
        max_norm=lc.MAX_NORM,
        vision=VisionPacking(vc.PATCH_DIM, vc.MERGE),
        max_patches_per_microbatch=32,
        balance_microbatches=True,
        temperature=PARAMS.temperature,
    )
    return Engine(
        model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        parallel_dims=dims,
        device=torch.device("cpu"),
        options=options,
    )


def run_vlm_grpo_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in VLM_GRPO_LAYOUTS:
        return
    # One rank runs in the test process: with the launched ranks' one thread its float kernels
    # round alike, which bitwise equal rollouts need.
    with lc.one_thread():
        results[layout_key(*layout)] = _run_steps(dims)


def _run_steps(dims: ParallelDims) -> list[dict]:
    cpu = torch.device("cpu")
    args = vc.model_args()
    model = build_model(args, parallel_dims=dims, device=cpu, seed=lc.SEED, param_dtype=torch.float32)
    reference = build_model(args, parallel_dims=dims, device=cpu, seed=lc.SEED, param_dtype=torch.float32)
    reference.requires_grad_(False)
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    engine = _engine(model, dims, optimizer, build_lr_scheduler(optimizer, 10, 0, "linear", 0.0))
    reference_engine = _engine(reference, dims)
    generator = TorchGenerator(args, cpu, max_prompts_per_batch=MAX_PROMPTS_PER_BATCH, vision=VISION)
    rank = dist.get_rank() if dist.is_initialized() else 0
    metrics = MetricsLogger(dims, cpu, rank, tb_folder=None, num_params=1, flops_per_token_context=1)
    prompts, images = step_prompts()
    peer_mesh = dims.mesh("cp_tp")
    steps = []
    for step in range(1, NUM_STEPS + 1):
        generator.update_weights(model, step - 1)
        slots_by_minibatch = rank_prompt_slots(len(prompts), NUM_MINIBATCHES, dims.batch_rank(), dims.batch_degree)
        slots = [s for mb in slots_by_minibatch for s in mb]
        local = generate_share(generator, prompts, slots, GROUP_SIZE, PARAMS, SEED, step, peer_mesh, 0, images)
        rollouts = exchange_among_peers(local, peer_mesh)
        groups = score_groups(rollouts, [reward(r) for r in rollouts], GROUP_SIZE, "grpo", 1e-6)
        minibatches = [to_samples([g for g in groups if g.slot in mb], 64, vision=VISION) for mb in slots_by_minibatch]
        # Step 1 trains each rank's own share (so with dp 2 a rank holds only text prompts),
        # step 2 balances, which sends samples and their images to other ranks.
        minibatches, _ = balance_over_data_parallel(minibatches, dims.mesh("batch"), step == 2, 40, 32)
        samples = [s for mb in minibatches for s in mb]
        for sample, ref, prox in zip(
            samples, reference_engine.forward(samples).logprobs, engine.forward(samples).logprobs
        ):
            sample.ref_logprobs = ref
            sample.prox_logprobs = torch.where(sample.loss_mask, prox, 0.0)
        logged = []
        for mb in minibatches:
            fb = engine.forward_backward(mb, "ppo", LOSS_OPTIONS)
            logged.append(metrics.reduce_update(fb, engine.optim_step()))
        mine = {
            "rollouts": [(r.prompt_index, r.sample_index, r.completion_tokens, r.logprobs, r.images) for r in local],
            "trained": [
                [(s.group_id, s.input_ids.tolist(), [i.patches for i in s.images or ()], s.vision_rows) for s in mb]
                for mb in minibatches
            ],
        }
        steps.append(
            {
                "ranks": gather_to_all(mine),
                "logged": logged,
                "params": {fqn: lc.full(p) for fqn, p in model.named_parameters()},
            }
        )
    return steps
