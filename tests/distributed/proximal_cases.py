"""The proximal policy taken from the update's own forward, inside the shared multi-rank launch
(``layout_worker.run_all_layouts``).

On the layouts of ``PROXIMAL_LAYOUTS`` (one rank, dp 2, cp 2, dp2 x tp2) every RL loss (KL and
entropy on, several micro-batches per rank) runs one update two ways from the same weights, as
the GRPO recipe does under ``rl.proximal``:

- ``separate``: ``Engine.forward`` recomputes the proximal log-probs, ``apply_rollout_correction``
  sets each token's weight from them, and ``forward_backward`` reads both (decoupled PPO);
- ``fused``: ``forward_backward`` with ``current_proximal`` computes the weights in its own pass
  and returns its log-probs, from which the recipe's metric functions (``rl/proximal.py``,
  ``rl/rollout_correction.py``) run after the update;

for a token-level, a sequence-level and a geometric-mean correction. Rank 0 records both paths'
gradients, logged loss and grad norm, every ``rl/*`` and ``rl/rollout_corr/*`` metric and its
share's proximal log-probs, and how many times the model ran, for test_proximal_layout.py. Kept
free of any reference computation.
"""

import torch

import layout_cases as lc
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.rl.proximal import set_proximal_logprobs
from torchtitan_rl.rl.rollout_correction import RolloutCorrection, apply_rollout_correction

PROXIMAL_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 2, 1, 2))
# The sampler's log-probs sit 0.3 (per token, normal) from the model's: each correction masks
# some tokens or sequences and keeps others.
CORRECTIONS = {
    "token": RolloutCorrection("icepop", "token", max_ratio=1.4, min_ratio=0.7),
    "sequence": RolloutCorrection("mis", "sequence", max_ratio=1.1),
    "geo_mask": RolloutCorrection("geo_mask", "sequence", max_ratio=1.1, min_ratio=0.9),
}
LOSS_FNS = ("importance_sampling", "ppo", "cispo", "gspo")
MODE, BUDGET = "sequence_mean", 24
STEP = 1  # the update's step: the rollouts are of the weights after step 0, not stale


def layout_key(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    return f"proximal/rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}"


def loss_options(loss_fn: str) -> dict:
    """The loss's clip bounds, KL and entropy from the layout test's RL cases, without its
    choice of old policy and weights (each path sets its own)."""
    config = dict(lc.RL_LOSS_FNS[loss_fn])
    config.pop("proximal_logprobs", None)
    config.pop("rollout_weights", None)
    return config


def rank_samples(dims: ParallelDims) -> list:
    """This data-parallel rank's contiguous share of the RL batch, sampled by the weights after step 0."""
    samples = lc.rl_batch()
    for sample in samples:
        sample.prox_logprobs = sample.rollout_weights = None
        sample.sampler_version = STEP - 1
    per_rank = lc.GLOBAL_BATCH_SIZE // dims.batch_degree
    return samples[dims.batch_rank() * per_rank : (dims.batch_rank() + 1) * per_rank]


def run_proximal_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in PROXIMAL_LAYOUTS:
        return
    device = torch.device("cpu")
    model = build_model(lc.model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32)
    engine = Engine(
        model,
        optimizer=None,
        lr_scheduler=None,
        parallel_dims=dims,
        device=device,
        options=EngineOptions(
            reduction=MODE, horizon=lc.HORIZON, max_tokens_per_microbatch=BUDGET, logits_chunk_size=16, max_norm=0.0
        ),
    )
    metrics = MetricsLogger(dims, device, 0, tb_folder=None, num_params=1, flops_per_token_context=1)
    num_forwards = [0]
    model.register_forward_pre_hook(lambda module, args: num_forwards.__setitem__(0, num_forwards[0] + 1))
    record: dict = {}
    for loss_fn in LOSS_FNS:
        for name, correction in CORRECTIONS.items():
            for path in ("separate", "fused"):
                samples = rank_samples(dims)
                num_forwards[0] = 0
                config = loss_options(loss_fn)
                values = {}
                if path == "separate":
                    proximal = engine.forward(samples).logprobs
                    values.update(set_proximal_logprobs(samples, proximal, STEP, dims.mesh("batch")))
                    values.update(apply_rollout_correction(samples, correction, dims.mesh("batch")))
                    config.update(proximal_logprobs=True, rollout_weights=True)
                    fb = engine.forward_backward(samples, loss_fn, config)
                else:
                    config.update(current_proximal=True, rollout_correction=correction)
                    fb = engine.forward_backward(samples, loss_fn, config, with_logprobs=True)
                    proximal = fb.logprobs
                    values.update(set_proximal_logprobs(samples, proximal, STEP, dims.mesh("batch")))
                    values.update(apply_rollout_correction(samples, correction, dims.mesh("batch")))
                grads = {fqn: lc.full(p.grad) for fqn, p in model.named_parameters()}
                norm = clip_grad_norm_(list(model.parameters()), 0.0)
                model.zero_grad(set_to_none=True)
                values.update(metrics.reduce_update(fb, {"grad_norm": norm, "lr": 0.0}))
                record[(loss_fn, name, path)] = {
                    "grads": grads,
                    "logged": values,
                    "proximal": [p.clone() for p in proximal],
                    "weights": [s.rollout_weights.clone() for s in samples],
                    "num_forwards": num_forwards[0],
                }
    results[layout_key(*layout)] = record
