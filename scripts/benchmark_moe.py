"""Qwen3-MoE training steps on CPU, measured: the expert kernels, and what the router losses cost.

    .venv/bin/python scripts/benchmark_moe.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_moe.py --no-write # print only

``Engine.forward_backward`` + ``optim_step`` of the ``debugmodel_moe`` flavor on ``--ranks`` gloo
ranks (FSDP; experts sharded over the expert mesh), on random sequences packed into
``--microbatches`` micro-batches per rank. Variants alternate for ``--repeats`` rounds (the
first is warm-up) and the medians are reported:

- the two expert kernels (``grouped_mm``, ``loop``) with the router losses off;
- the router losses off, the global load-balancing loss with the z-loss (a no-grad counting pass
  over the micro-batches, then one all-reduce of the counts), and the sequence scope (one
  all-reduce per micro-batch), all with ``grouped_mm``: their overhead as a share of the step.
"""

import argparse
import statistics
import time

from bench_common import add_publish_args, alternating_order, launch_workers, print_result, publish, ratio


def worker(args) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from torchtitan_rl.data.sample import Sample
    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.distributed.utils import init_distributed
    from torchtitan_rl.engine import Engine, EngineOptions
    from torchtitan_rl.losses.router import RouterLossConfig
    from torchtitan_rl.models.qwen3.args import qwen3_flavors
    from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
    from torchtitan_rl.recipes.base import build_model

    rank, world, device = init_distributed(300)
    dims = ParallelDims(1, -1, 1, 1, world_size=world)
    dims.build_meshes("cpu")
    gen = torch.Generator().manual_seed(rank)
    samples = []
    for _ in range(args.microbatches):
        ids = torch.randint(0, 500, (args.tokens + 1,), generator=gen)
        samples.append(Sample(input_ids=ids[:-1], labels=ids[1:], loss_mask=torch.ones(args.tokens, dtype=torch.bool)))
    engines = {}
    for impl in ("grouped_mm", "loop"):
        model_args = dataclasses.replace(qwen3_flavors["debugmodel_moe"], experts_impl=impl, attn_backend="sdpa_loop")
        model = build_model(model_args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32)
        optimizer = build_optimizer(model, 1e-5, 0.9, 0.95, 1e-8, 0.0)
        scheduler = build_lr_scheduler(optimizer, 10**6, 0, "linear", 0.0)
        routers = (
            {"off": RouterLossConfig()}
            if impl == "loop"
            else {
                "off": RouterLossConfig(),
                "global": RouterLossConfig(aux_loss_coef=0.01, aux_loss_scope="global", z_loss_coef=0.001),
                "sequence": RouterLossConfig(aux_loss_coef=0.01, aux_loss_scope="sequence", z_loss_coef=0.001),
            }
        )
        for name, router in routers.items():
            options = EngineOptions(
                reduction="token_mean",
                horizon=1,
                max_tokens_per_microbatch=args.tokens,
                logits_chunk_size=1024,
                max_norm=1.0,
                router=router,
            )
            engines[f"{impl}/{name}"] = Engine(
                model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
            )
    times: dict[str, list[float]] = {name: [] for name in engines}
    # Alternating like bench_common.time_alternating, with barriers so that every rank times the
    # same step; the first round warms up.
    for round_, order in enumerate(alternating_order(list(engines), args.repeats + 1)):
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            engines[name].forward_backward(samples)
            engines[name].optim_step()
            dist.barrier()
            if round_ > 0:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        print_result({name: statistics.median(values) for name, values in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches (one sequence each) per rank")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=10)
    add_publish_args(parser, "moe")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    t = launch_workers(
        __file__,
        args.ranks,
        ["--microbatches", str(args.microbatches), "--tokens", str(args.tokens), "--repeats", str(args.repeats)],
    )
    if "error" in t:
        raise SystemExit(f"the ranks failed: {t['error']}")
    off = t["grouped_mm/off"]

    def overhead(name: str) -> str:
        return f"{t[name] * 1000:.0f} ms (+{(t[name] - off) / t[name] * 100:.0f} % of the step"

    body = [
        (
            f"`debugmodel_moe` (8 experts, top-2), {args.ranks} FSDP gloo ranks, {args.microbatches} micro-batches of "
            f"{args.tokens} tokens per rank, median of {args.repeats} alternating rounds:"
        ),
        "",
        (
            f"- Expert kernels, router losses off: `grouped_mm` {off * 1000:.0f} ms per step, per-expert `loop` "
            f"{t['loop/off'] * 1000:.0f} ms ({ratio(t['loop/off'], off)})."
        ),
        (
            f"- Router losses (`grouped_mm`): global scope + z-loss {overhead('grouped_mm/global')}: the no-grad counting "
            f"pass over the {args.microbatches} micro-batches and one all-reduce of the counts); sequence scope + z-loss "
            f"{overhead('grouped_mm/sequence')}, one small all-reduce per micro-batch, no counting pass)."
        ),
    ]
    publish(
        args,
        "Qwen3-MoE training step",
        "Step time of the MoE expert kernels (`grouped_mm`, `loop`) and what "
        "the router losses (global and sequence scope, z-loss) add to a step.",
        body,
    )


if __name__ == "__main__":
    main()
