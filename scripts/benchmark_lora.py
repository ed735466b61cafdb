"""LoRA against full fine-tuning on CPU: SFT step time and peak memory at the same model and
layout, and the bytes GRPO's weight sync moves with and without adapters.

    .venv/bin/python scripts/benchmark_lora.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_lora.py --no-write # print only

SFT: a Qwen3 of ``--dim`` width and ``--layers`` layers (vocabulary ``--vocab``) on 2 gloo ranks
(FSDP over both), mini-batches of ``--batch`` random sequences of ``--seq-len`` tokens, one
micro-batch per rank. Every variant runs in fresh processes, so each rank's peak resident
memory (``ru_maxrss``) is that variant's alone: ``full`` trains every weight; ``lora`` trains
rank-``--rank`` adapters on every projection (the base frozen, float32); ``lora bf16 base``
also stores the frozen base in bfloat16 (``lora.base_dtype``). Step times are medians of
``--steps`` steps after a warm-up step that also allocates the optimizer state; the variants
run ``--rounds`` times each, alternating, and the table shows the median round.

GRPO weight sync: ``train_configs/debug_grpo.toml`` for ``--grpo-steps`` RL steps on 2 ranks
(colocated, and 1 trainer + 1 rollout rank), without and with LoRA; ``comm/weight_sync_bytes``
is what one sync moves at the first step (the whole model) and at the last step.
"""

import argparse
import resource
import statistics
import time

from bench_common import (
    add_publish_args,
    alternating_order,
    launch_workers,
    markdown_table,
    print_result,
    publish,
    ratio,
    run_train,
)

VARIANTS = {
    "full": [],
    "lora": ["lora"],
    "lora bf16 base": ["lora", "bf16"],
}
GRPO_RECIPE = "train_configs/debug_grpo.toml"


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan_rl.data.sample import Sample
    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.distributed.utils import init_distributed, shutdown_distributed
    from torchtitan_rl.engine import Engine, EngineOptions
    from torchtitan_rl.models.lora import LoRASettings
    from torchtitan_rl.models.qwen3.args import Qwen3ModelArgs
    from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
    from torchtitan_rl.recipes.base import build_model

    rank, world_size, device = init_distributed(1800)
    dims = ParallelDims(1, world_size, 1, 1, world_size)
    dims.build_meshes(device.type)
    model_args = Qwen3ModelArgs(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.dim // 64,
        n_kv_heads=max(1, args.dim // 256),
        head_dim=64,
        hidden_dim=3 * args.dim,
        max_seq_len=args.seq_len,
        attn_backend="sdpa_varlen",
    )
    lora = None
    if "lora" in args.features:
        lora = LoRASettings(
            rank=args.rank,
            alpha=2.0 * args.rank,
            base_dtype=torch.bfloat16 if "bf16" in args.features else torch.float32,
        )
    model = build_model(model_args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32, lora=lora)
    optimizer = build_optimizer(model, 1e-4, 0.9, 0.95, 1e-8, 0.0)
    scheduler = build_lr_scheduler(optimizer, args.steps + 1, 0, "linear", 1.0)
    options = EngineOptions(
        reduction="token_mean", horizon=args.seq_len, max_tokens_per_microbatch=0, logits_chunk_size=1024, max_norm=1.0
    )
    engine = Engine(
        model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
    )
    gen = torch.Generator().manual_seed(rank)
    samples = [
        Sample(
            input_ids=torch.randint(0, args.vocab, (args.seq_len,), generator=gen),
            labels=torch.randint(0, args.vocab, (args.seq_len,), generator=gen),
            loss_mask=torch.ones(args.seq_len, dtype=torch.bool),
        )
        for _ in range(args.batch // world_size)
    ]
    seconds = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        engine.forward_backward(samples)
        engine.optim_step()
        if step > 0:
            seconds.append(time.perf_counter() - start)
    # Global sizes: a DTensor (an FSDP shard) reports the whole parameter's.
    trainable = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    result = (statistics.median(seconds), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    per_rank = [None] * world_size
    dist.all_gather_object(per_rank, result)
    shutdown_distributed(clean=True)
    if rank == 0:
        print_result(
            {
                "step_s": max(s for s, _ in per_rank),
                "peak_rss_gib": max(r for _, r in per_rank) / 2**30,
                "trainable": trainable,
                "params": sum(p.numel() for p in model.parameters()),
            }
        )


def sft_rows(args) -> tuple[list[list[str]], dict]:
    worker_args = [
        f"--{key}={getattr(args, key.replace('-', '_'))}"
        for key in ("dim", "layers", "vocab", "seq-len", "batch", "steps", "rank")
    ]
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for order in alternating_order(list(VARIANTS), args.rounds):
        for name in order:
            features = VARIANTS[name]
            result = launch_workers(__file__, 2, [*worker_args, "--features", *(features or ["none"])])
            if "error" in result:
                raise RuntimeError(f"{name}: {result['error']}")
            runs[name].append(result)
    median = {
        name: {key: statistics.median(r[key] for r in results) for key in ("step_s", "peak_rss_gib")}
        for name, results in runs.items()
    }
    rows = []
    for name, results in runs.items():
        m = median[name]
        rows.append(
            [
                name,
                f"{results[0]['trainable'] / 1e6:.2f}M of {results[0]['params'] / 1e6:.2f}M",
                f"{m['step_s']:.2f} s ({ratio(m['step_s'], median['full']['step_s'])})",
                f"{m['peak_rss_gib']:.2f} GiB ({ratio(m['peak_rss_gib'], median['full']['peak_rss_gib'])})",
            ]
        )
    return rows, median


def grpo_rows(args) -> list[list[str]]:
    layouts = {"colocated (2 ranks)": [], "1 trainer + 1 rollout rank": ["--parallelism.rollout_ranks", "1"]}
    rows = []
    for layout, layout_args in layouts.items():
        later_full = None
        for name, lora_args in (("full", []), ("lora", ["--lora.enable", "true", "--lora.rank", str(args.rank)])):
            run = run_train(
                [
                    "--job.config_file",
                    GRPO_RECIPE,
                    "--training.steps",
                    str(args.grpo_steps),
                    "--rl.sft_warmup_steps",
                    "0",
                    "--metrics.log_freq",
                    "1",
                    *layout_args,
                    *lora_args,
                ]
            )
            sent = run.series("comm/weight_sync_bytes")
            first, later = sent[min(sent)], sent[max(sent)]
            if name == "full":
                later_full = later
            shown = f"{later / 2**20:.3f} MiB"
            if name != "full":
                shown += f" ({ratio(later, later_full, 3)})"
            rows.append([layout, name, f"{first / 2**20:.2f} MiB", shown])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--features", nargs="+", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--grpo-steps", type=int, default=3)
    add_publish_args(parser, "lora")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sft, median = sft_rows(args)
    grpo = grpo_rows(args)
    body = [
        (
            f"SFT on 2 ranks (FSDP), a Qwen3 of dim {args.dim}, {args.layers} layers, vocab {args.vocab}; "
            f"{args.batch} sequences of {args.seq_len} tokens per step; adapters of rank {args.rank} on every "
            f"projection. Median of {args.rounds} alternating rounds of {args.steps} steps each; peak RSS is the "
            "larger rank's:"
        ),
        "",
        *markdown_table(["variant", "trained parameters", "step time", "peak RSS per rank"], sft),
        "",
        (
            f"GRPO weight sync, `{GRPO_RECIPE}` (debug model), {args.grpo_steps} RL steps without warm-up; "
            "`comm/weight_sync_bytes` of the first sync (the whole model) and of the last step's:"
        ),
        "",
        *markdown_table(["layout", "variant", "first sync", "later syncs"], grpo),
    ]
    lora_time = median["lora"]["step_s"] / median["full"]["step_s"]
    lora_rss = median["lora"]["peak_rss_gib"] / median["full"]["peak_rss_gib"]
    summary = (
        f"LoRA SFT step {lora_time:.2f}x the time and {lora_rss:.2f}x the peak memory of full fine-tuning; "
        "GRPO syncs only the adapters after the first step."
    )
    publish(args, "LoRA against full fine-tuning", summary, body)


if __name__ == "__main__":
    main()
