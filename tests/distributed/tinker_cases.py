"""Tinker's built-in losses inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``TINKER_LAYOUTS`` (one rank, dp 2, tp 2, cp 2, dp2 x tp2) every loss of
``service.tinker_losses`` runs as the service runs it: the datums below, this data-parallel
rank's contiguous share of them, converted by ``to_engine`` and trained under reduction "sum"
in micro-batches of at most ``BUDGET`` tokens (several per rank), two ``forward_backward`` calls
whose gradients accumulate (as until a Tinker ``optim_step``). Rank 0 records each call's
``loss:sum``, its share's per-datum log-probs and the gradients after both calls, for
test_tinker_layout.py. Kept free of any reference computation.
"""

import math

import torch

import layout_cases as lc
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.recipes.base import build_model
from torchtitan_rl.service.operations import TinkerDatum
from torchtitan_rl.service.tinker_losses import forward_backward_metrics, to_engine

TINKER_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 2))
BUDGET = 24  # the longest datum: several micro-batches per rank, and training.seq_len
# Each loss's loss_fn_config: ppo at Tinker's defaults, the others set so their clips bind.
CONFIGS = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {},
    "cispo": {"clip_low_threshold": 0.75, "clip_high_threshold": 1.3},
    "dro": {"beta": 0.5},
    "gspo": {"clip_low_threshold": 0.95, "clip_high_threshold": 1.04},
}
# Datum lengths of the two calls; 8 datums each, split evenly by dp 2.
CALL_LENGTHS = ((23, 5, 17, 9, 1, 12, 24, 3), (6, 19, 2, 11, 14, 4, 8, 21))


def layout_key(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> str:
    return f"tinker/rep{dp_replicate}_shard{dp_shard}_cp{cp}_tp{tp}"


def datums(loss_fn: str, call: int) -> list[TinkerDatum]:
    """The call's datums with every input of ``loss_fn``: sampler log-probs near the initial
    model's (about -log VOCAB, 0.3 normal noise), advantages and CE weights of both signs, GSPO
    masks on a suffix of each datum (none on the 1-token datum)."""
    gen = torch.Generator().manual_seed(100 + call)
    out = []
    for n in CALL_LENGTHS[call]:
        tokens = torch.randint(0, lc.VOCAB, (n,), generator=gen).tolist()
        inputs = {"target_tokens": torch.randint(0, lc.VOCAB, (n,), generator=gen)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = torch.where(torch.rand(n, generator=gen) < 0.2, 0.0, torch.randn(n, generator=gen))
        else:
            inputs["logprobs"] = -math.log(lc.VOCAB) + 0.3 * torch.randn(n, generator=gen)
            inputs["advantages"] = torch.randn(n, generator=gen)
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (torch.arange(n) >= n // 2).float() * (torch.arange(n) > 0)
        out.append(TinkerDatum(tokens, inputs))
    return out


def rank_datums(dims: ParallelDims, loss_fn: str, call: int) -> list[TinkerDatum]:
    per_rank = len(CALL_LENGTHS[call]) // dims.batch_degree
    return datums(loss_fn, call)[dims.batch_rank() * per_rank : (dims.batch_rank() + 1) * per_rank]


def run_tinker_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in TINKER_LAYOUTS:
        return
    device = torch.device("cpu")
    model = build_model(lc.model_args(), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32)
    options = EngineOptions(
        reduction="sum", horizon=lc.HORIZON, max_tokens_per_microbatch=BUDGET, logits_chunk_size=16, max_norm=0.0
    )
    engine = Engine(model, optimizer=None, lr_scheduler=None, parallel_dims=dims, device=device, options=options)
    record = {}
    for loss_fn, config in CONFIGS.items():
        loss_sums, logprobs = [], []
        for call in range(len(CALL_LENGTHS)):
            engine_call = to_engine(
                rank_datums(dims, loss_fn, call), loss_fn, config, vocab_size=lc.VOCAB, max_len=BUDGET
            )
            fb = engine.forward_backward(*engine_call, with_logprobs=True)
            loss_sums.append(forward_backward_metrics(fb, dims.mesh("loss"))["loss:sum"])
            logprobs.append(fb.logprobs)
        record[loss_fn] = {
            "loss_sums": loss_sums,
            "logprobs": logprobs,
            "grads": {fqn: lc.full(p.grad) for fqn, p in model.named_parameters()},
        }
        model.zero_grad(set_to_none=True)
    results[layout_key(*layout)] = record
