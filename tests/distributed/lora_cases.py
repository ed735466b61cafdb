"""LoRA layouts inside the shared multi-rank launch (``layout_worker.run_all_layouts``).

On the layouts of ``LORA_LAYOUTS`` a model with adapters on every attention and MLP projection
and on the output head, and a trainable input embedding, runs the "uneven" batch with several
micro-batches per rank: token_mean with a clipped AdamW step, and sequence_mean. Adapters get
nonzero values (B starts at zero otherwise, which would leave A without a gradient). Rank 0
records gradients, logged numbers and weights for test_lora_layout.py.
"""

import zlib

import torch
import torch.distributed as dist

import layout_cases as lc
from torchtitan_rl.distributed.clip import clip_grad_norm_
from torchtitan_rl.distributed.parallel_dims import ParallelDims
from torchtitan_rl.engine import Engine, EngineOptions
from torchtitan_rl.metrics import MetricsLogger
from torchtitan_rl.models.lora import LoRASettings, is_adapter_key
from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
from torchtitan_rl.recipes.base import build_model

# (dp_replicate, dp_shard, cp, tp): one rank, dp 2, tp 2, cp 2, dp2 x tp2.
LORA_LAYOUTS = ((1, 1, 1, 1), (1, 2, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 1, 2))
SETTINGS = LoRASettings(
    rank=4,
    alpha=8.0,
    target_modules=("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output"),
    train_embeddings=True,
)
BUDGET = 24
# (reduction mode, whether the case clips and takes an AdamW step)
CASES = (("sequence_mean", False), ("token_mean", True))
ADAPTER_STD = 0.2


def adapter_values(fqn: str, shape) -> torch.Tensor:
    """The adapter values every layout (and the reference) uses: drawn from the name alone."""
    return ADAPTER_STD * torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(fqn.encode())))


@torch.no_grad()
def set_adapters(model: torch.nn.Module) -> None:
    for fqn, param in model.named_parameters():
        if is_adapter_key(fqn):
            full = adapter_values(fqn, param.shape)
            lc.set_full_(param, full)


def case_key(layout: tuple, name: str) -> str:
    return "lora/rep{}_shard{}_cp{}_tp{}".format(*layout) + f"/{name}"


def run_lora_checks(dims: ParallelDims, results: dict) -> None:
    layout = (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    if layout not in LORA_LAYOUTS:
        return
    device = torch.device("cpu")
    model = build_model(
        lc.model_args(False), parallel_dims=dims, device=device, seed=lc.SEED, param_dtype=torch.float32, lora=SETTINGS
    )
    set_adapters(model)
    optimizer = build_optimizer(model, lc.LR, 0.9, 0.95, lc.ADAM_EPS, 0.1)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "linear", 0.0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    metrics = MetricsLogger(dims, device, rank, tb_folder=None, num_params=1, flops_per_token_context=1)
    share = lc.GLOBAL_BATCH_SIZE // dims.batch_degree
    samples = lc.global_batch("uneven")[dims.batch_rank() * share : (dims.batch_rank() + 1) * share]
    results[case_key(layout, "init")] = {fqn: lc.full(p) for fqn, p in model.named_parameters()}
    results[case_key(layout, "optimizer_numel")] = sum(
        lc.full(p).numel() for group in optimizer.param_groups for p in group["params"]
    )
    for mode, step in CASES:
        options = EngineOptions(
            reduction=mode,
            horizon=lc.HORIZON,
            max_tokens_per_microbatch=BUDGET,
            logits_chunk_size=16,
            max_norm=lc.MAX_NORM if step else 0.0,
        )
        engine = Engine(
            model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
        )
        fb = engine.forward_backward(samples)
        grads = {fqn: lc.full(p.grad) for fqn, p in model.named_parameters() if p.grad is not None}
        if step:
            optim = engine.optim_step()
        else:
            optim = {"grad_norm": clip_grad_norm_(list(model.parameters()), 0.0), "lr": lc.LR}
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
        entry = {"grads": grads, "logged": logged}
        if step:
            entry["params"] = {fqn: lc.full(p) for fqn, p in model.named_parameters()}
        results[case_key(layout, mode)] = entry
