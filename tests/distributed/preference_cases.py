"""Preference losses inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``PREFERENCE_LAYOUTS`` (one rank, dp 2, tp 2, cp 2, dp2 x tp2, dp2 x cp2)
``recipes.dpo.preference_step`` runs DPO (label smoothing and the chosen NLL term on), IPO and SimPO on the pairs
below, and DPO on a MoE model with its router losses and on a LoRA model (reference: its base,
adapters off), and the Bradley–Terry loss of a reward model (centering on). The global batch lists every pair's chosen completion, then every rejected one,
so data parallel puts the two completions of a pair on different ranks; ``BUDGET`` packs each
rank's share into several micro-batches. Some pairs carry a margin (``MARGINS``), which the
reward model's loss reads and the others ignore. Rank 0 records each case's gradients and values
for test_preference_layout.py. Kept free of any reference computation.
"""

import torch

import layout_cases as lc
import lora_cases
import moe_cases
from torchtitan_rl.data.sample import Sample
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.engine_scores import ScoreEngine
from torchtitan_rl.losses.preference import PreferenceLoss
from torchtitan_rl.losses.reduction import NUM_MICROBATCHES
from torchtitan_rl.losses.reward_model import RewardModelLoss
from torchtitan_rl.losses.router import RouterLossConfig
from torchtitan_rl.models.qwen3.args import as_reward_model
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.recipes.dpo import preference_step
from torchtitan_rl.recipes.reference import base_logprobs
from torchtitan_rl.recipes.reward_model import reward_model_step

PREFERENCE_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 2), (1, 2, 2, 1))
BUDGET = 24
REFERENCE_SEED = lc.SEED + 1  # the reference model of the dense cases: other weights than the policy's
# (prompt, chosen, rejected) lengths of the pairs; the longest pair is 23 tokens.
PAIRS = ((5, 3, 6), (2, 7, 1), (6, 9, 8), (3, 2, 2), (8, 4, 11), (1, 5, 3))
# Each pair's margin: 0 (none) on some, of either sign on others.
MARGINS = (0.0, 1.5, 0.0, -0.75, 2.0, 0.5)
LOSSES = {
    "dpo": PreferenceLoss("dpo", beta=0.7, label_smoothing=0.1, nll_coef=0.3),
    "ipo": PreferenceLoss("ipo", beta=0.4),
    "simpo": PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.8),
}
REWARD_MODEL_LOSS = RewardModelLoss(center_coef=0.3)
MOE_ROUTER = RouterLossConfig(aux_loss_coef=0.3, aux_loss_scope="global", aux_loss_layers="pooled", z_loss_coef=0.01)


def pair_tokens() -> list[tuple[list[int], list[int], list[int]]]:
    gen = torch.Generator().manual_seed(77)
    return [tuple(torch.randint(0, lc.VOCAB, (n,), generator=gen).tolist() for n in lengths) for lengths in PAIRS]


def global_samples() -> list[Sample]:
    """Every pair's chosen completion, then every rejected one (loss on the completion)."""
    samples = []
    for preferred in (True, False):
        for index, (prompt, chosen, rejected) in enumerate(pair_tokens()):
            completion = chosen if preferred else rejected
            sample = Sample.from_tokens(prompt + completion, [False] * len(prompt) + [True] * len(completion))
            sample.group_id, sample.preferred, sample.margin = index, preferred, MARGINS[index]
            samples.append(sample)
    return samples


def rank_samples(dims: ParallelDims) -> list[Sample]:
    samples = global_samples()
    share = len(samples) // dims.batch_degree
    return samples[dims.batch_rank() * share : (dims.batch_rank() + 1) * share]


def case_key(layout: tuple, name: str) -> str:
    return "preference/rep{}_shard{}_cp{}_tp{}".format(*layout) + f"/{name}"


def engine_for(model, dims: ParallelDims, router: RouterLossConfig | None = None, engine_class=Engine) -> Engine:
    options = EngineOptions(
        reduction="sum",
        horizon=lc.HORIZON,
        max_tokens_per_microbatch=BUDGET,
        logits_chunk_size=16,
        max_norm=0.0,
        router=router,
    )
    return engine_class(
        model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=torch.device("cpu"), options=options
    )


def run_case(engine: Engine, dims: ParallelDims, loss, reference=None) -> dict:
    if isinstance(loss, RewardModelLoss):
        fb, values = reward_model_step(engine, rank_samples(dims), loss, len(PAIRS))
    else:
        fb, values = preference_step(engine, rank_samples(dims), loss, len(PAIRS), reference)
    grads = {fqn: lc.full(p.grad) for fqn, p in engine.model.named_parameters() if p.requires_grad}
    engine.model.zero_grad(set_to_none=True)
    return {"grads": grads, "values": values, "num_microbatches": int(fb.counts[NUM_MICROBATCHES])}


def run_preference_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in PREFERENCE_LAYOUTS:
        return
    device = torch.device("cpu")

    def dense(seed: int):
        return build_model(lc.model_args(), parallel_dims=dims, device=device, seed=seed, param_dtype=torch.float32)

    engine, reference = engine_for(dense(lc.SEED), dims), engine_for(dense(REFERENCE_SEED), dims)
    for name, loss in LOSSES.items():
        results[case_key(layout, name)] = run_case(engine, dims, loss, lambda s: reference.forward(s).logprobs)

    moe = build_model(
        moe_cases.model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32
    )
    moe_cases.set_router_weights(moe)
    moe_reference = build_model(
        moe_cases.model_args(), parallel_dims=dims, device=device, seed=REFERENCE_SEED, param_dtype=torch.float32
    )
    moe_reference.requires_grad_(False)
    moe_reference_engine = engine_for(moe_reference, dims, MOE_ROUTER)
    results[case_key(layout, "dpo_moe")] = run_case(
        engine_for(moe, dims, MOE_ROUTER), dims, LOSSES["dpo"], lambda s: moe_reference_engine.forward(s).logprobs
    )

    lora = build_model(
        lc.model_args(),
        parallel_dims=dims,
        device=device,
        seed=lc.SEED,
        param_dtype=torch.float32,
        lora=lora_cases.SETTINGS,
    )
    lora_cases.set_adapters(lora)
    lora_engine = engine_for(lora, dims)
    results[case_key(layout, "dpo_lora")] = run_case(
        lora_engine, dims, LOSSES["dpo"], lambda s: base_logprobs(lora_engine, s)
    )

    reward_model = build_model(
        as_reward_model(lc.model_args()), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32
    )
    results[case_key(layout, "reward_model")] = run_case(
        engine_for(reward_model, dims, engine_class=ScoreEngine), dims, REWARD_MODEL_LOSS
    )
