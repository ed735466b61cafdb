"""Vision-language layouts inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``VLM_LAYOUTS`` a tiny VLM (Pixtral tower + merger + projector on the Qwen3
of ``layout_cases``) runs ``forward_backward`` on a global batch with uneven image counts and
sizes, for two reduction modes, two micro-batch budgets (tokens and vision patches) and DP
compute balancing off and on, then one clipped AdamW step. Rank 0 records gradients, logged
numbers and parameters for test_vlm_layout.py. Then DPO on the same samples as four pairs
(``run_vlm_dpo``, for test_vlm_dpo_layout.py). Kept free of any reference computation.
"""

import dataclasses

import torch
import torch.distributed as dist

import layout_cases as lc
from torchtitan_rl.data.balance import assign_to_ranks
from torchtitan_rl.data.packing import VisionPacking
from torchtitan_rl.data.sample import Sample, SampleImage
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.losses.preference import PreferenceLoss
from torchtitan_rl.losses.reduction import NUM_MICROBATCHES
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.vision.args import VisionArgs
from torchtitan_rl.models.vlm.args import VLMModelArgs
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.recipes.dpo import preference_step

# (dp_replicate, dp_shard, cp, tp): dp 1 / 2 / 4, tp 2, cp 2, dp2 x cp2.
VLM_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1), (1, 4, 1, 1), (1, 2, 2, 1))
MODES = ("token_mean", "sequence_mean")
# (max tokens, max vision patches) per micro-batch: one micro-batch per rank, and budgets that
# split by tokens and by patches (samples 0 and 1 have 16 patches each).
BUDGETS = ((0, 0), (24, 16))
IMAGE_ID, BREAK_ID, END_ID = lc.VOCAB - 3, lc.VOCAB - 2, lc.VOCAB - 1
MERGE = 2
PATCH_DIM = 3 * 2 * 2  # RGB, 2x2-pixel patches


def model_args() -> VLMModelArgs:
    vision = VisionArgs(
        dim=16,
        n_layers=2,
        n_heads=2,
        hidden_dim=24,
        patch_size=2,
        num_channels=3,
        max_patches_per_side=8,
        attn_backend="sdpa_dense",
    )
    text = dataclasses.asdict(lc.model_args(False))
    return VLMModelArgs(**text, vision=vision, spatial_merge_size=MERGE, image_token_id=IMAGE_ID)


# Per sample: (length, [image patch grids], where the first image's placeholders start, loss
# from this position on, or None for no loss token). Samples 4-7 have no image, so with dp = 2
# rank 1 (and with dp = 4 ranks 2 and 3) sees no image in the whole step; sample 1's
# placeholders (positions 2..7) straddle the chunk boundary at 4 of cp = 2; samples 2 and 3
# have no loss token (sample 3 has an image nonetheless).
_SAMPLES = (
    (22, [(2, 4), (4, 2)], 1, 13),
    (16, [(4, 4)], 2, 10),
    (9, [], 0, None),
    (8, [(2, 2)], 3, None),
    (5, [], 0, 1),
    (12, [], 0, 6),
    (24, [], 0, 3),
    (3, [], 0, 1),
)


def placeholders(rows: int, cols: int) -> list[int]:
    """Pixtral's layout: per merged row [IMG] x merged cols, then [IMG_BREAK]; the last is [IMG_END]."""
    tokens = []
    for r in range(rows // MERGE):
        tokens += [IMAGE_ID] * (cols // MERGE) + [BREAK_ID if r < rows // MERGE - 1 else END_ID]
    return tokens


def global_batch() -> list[Sample]:
    gen = torch.Generator().manual_seed(8)
    samples = []
    for n, grids, start, loss_from in _SAMPLES:
        ids = torch.randint(0, IMAGE_ID, (n,), generator=gen)
        labels = torch.randint(0, IMAGE_ID, (n,), generator=gen)
        rows = torch.full((n,), -1)
        images, at, feature = [], start, 0
        for r, c in grids:
            tokens = torch.tensor(placeholders(r, c))
            ids[at : at + len(tokens)] = tokens
            for t in (tokens == IMAGE_ID).nonzero()[:, 0].tolist():
                rows[at + t] = feature
                feature += 1
            images.append(SampleImage(torch.randn(r * c, PATCH_DIM, generator=gen), r, c))
            at += len(tokens) + 1  # one text token between images
        mask = torch.zeros(n, dtype=torch.bool) if loss_from is None else torch.arange(n) >= loss_from
        samples.append(
            Sample(
                input_ids=ids,
                labels=labels,
                loss_mask=mask,
                images=images or None,
                vision_rows=rows if images else None,
            )
        )
    return samples


def rank_samples(samples: list[Sample], dims: ParallelDims, balance: bool, budget: tuple = (0, 0)) -> list[Sample]:
    """This DP rank's samples: a contiguous slice, or the balanced assignment for micro-batches
    of ``budget`` (tokens, vision patches)."""
    if not balance:
        share = len(samples) // dims.batch_degree
        return samples[dims.batch_rank() * share : (dims.batch_rank() + 1) * share]
    indices = assign_to_ranks(
        [len(s) for s in samples],
        dims.batch_degree,
        num_patches=[s.num_patches for s in samples],
        max_tokens=budget[0],
        max_patches=budget[1],
    )
    return [samples[i] for i in indices[dims.batch_rank()]]


def case_key(layout: tuple, mode: str, budget: tuple, balance: bool, step: bool = False) -> str:
    return (
        "vlm/rep{}_shard{}_cp{}_tp{}".format(*layout)
        + f"/{mode}/budget{budget[0]}_{budget[1]}"
        + ("/balanced" if balance else "")
        + ("/step" if step else "")
    )


def run_vlm_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in VLM_LAYOUTS:
        return
    device = torch.device("cpu")
    args = model_args()
    run_vlm_dpo(dims, results)
    model = build_model(args, parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32)
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    metrics = MetricsLogger(dims, device, rank, tb_folder=None, num_params=1, flops_per_token_context=1)
    vision = VisionPacking(PATCH_DIM, MERGE)
    cases = [(mode, budget, balance, False) for mode in MODES for budget in BUDGETS for balance in (False, True)]
    cases.append(("token_mean", BUDGETS[1], True, True))  # clipped AdamW step; must stay last
    for mode, budget, balance, step in cases:
        options = EngineOptions(
            reduction=mode,
            horizon=lc.HORIZON,
            max_tokens_per_microbatch=budget[0],
            logits_chunk_size=16,
            max_norm=lc.MAX_NORM if step else 0.0,
            vision=vision,
            max_patches_per_microbatch=budget[1],
            balance_microbatches=balance,
        )
        engine = Engine(
            model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
        )
        samples = rank_samples(global_batch(), dims, balance, budget)
        fb = engine.forward_backward(samples)
        grads = {fqn: lc.full(p.grad) for fqn, p in model.named_parameters()}
        optim = (
            engine.optim_step() if step else {"grad_norm": clip_grad_norm_(list(model.parameters()), 0.0), "lr": lc.LR}
        )
        if not step:
            model.zero_grad(set_to_none=True)
        logged = metrics.log(
            1,
            fb=fb,
            optim=optim,
            window_tokens=fb.counts[0],
            window_squared_lens=fb.counts[0],
            window_seconds=1.0,
            data_stats={},
        )
        entry = {"grads": grads, "logged": logged, "num_images": [s.num_patches > 0 for s in samples].count(True)}
        if step:
            entry["params"] = {fqn: lc.full(p) for fqn, p in model.named_parameters()}
        gathered = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_gather_object(gathered, entry["num_images"])
        else:
            gathered = [entry["num_images"]]
        entry["images_per_rank"] = gathered
        results[case_key(layout, mode, budget, balance, step)] = entry


# DPO with images: the global batch's first four samples are the chosen completions of pairs
# 0-3, the last four their rejected ones, so data parallel puts a pair's two sides on different
# ranks (and with dp = 2 rank 1 holds no image); the budget splits them into micro-batches.
# Samples 2 and 3 have no loss token: their log-prob sums are 0.
VLM_DPO_LOSS = PreferenceLoss("dpo", beta=0.7, label_smoothing=0.1, nll_coef=0.3)
VLM_DPO_REFERENCE_SEED = lc.SEED + 1


def vlm_dpo_key(layout: tuple) -> str:
    return "vlm_dpo/rep{}_shard{}_cp{}_tp{}".format(*layout)


def run_vlm_dpo(dims: ParallelDims, results: dict) -> None:
    device = torch.device("cpu")
    options = EngineOptions(
        reduction="sum",
        horizon=lc.HORIZON,
        max_tokens_per_microbatch=BUDGETS[1][0],
        logits_chunk_size=16,
        max_norm=0.0,
        vision=VisionPacking(PATCH_DIM, MERGE),
        max_patches_per_microbatch=BUDGETS[1][1],
    )

    def engine(seed: int) -> Engine:
        model = build_model(model_args(), parallel_dims=dims, device=device, seed=seed, param_dtype=torch.float32)
        return Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=device, options=options)

    policy, reference = engine(lc.SEED), engine(VLM_DPO_REFERENCE_SEED)
    reference.model.requires_grad_(False)
    samples = global_batch()
    num_pairs = len(samples) // 2
    for i, sample in enumerate(samples):
        sample.group_id, sample.preferred = i % num_pairs, i < num_pairs
    share = len(samples) // dims.batch_degree
    mine = samples[dims.batch_rank() * share : (dims.batch_rank() + 1) * share]
    fb, values = preference_step(policy, mine, VLM_DPO_LOSS, num_pairs, lambda s: reference.forward(s).logprobs)
    results[vlm_dpo_key((dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp))] = {
        "grads": {fqn: lc.full(p.grad) for fqn, p in policy.model.named_parameters()},
        "values": values,
        "num_microbatches": int(fb.counts[NUM_MICROBATCHES]),
    }
