"""Expert parallel against FSDP-sharded experts, measured: step time, peak memory and the bytes
each rank moves.

    .venv/bin/python scripts/benchmark_expert_parallel.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_expert_parallel.py --no-write # print only

``Engine.forward_backward`` + ``optim_step`` on ``--ranks`` gloo ranks (FSDP over all of them) of
``debugmodel_moe`` widened (``--experts`` experts of hidden size ``--expert-hidden``, model dim
``--dim``), with ``parallelism.expert_parallel_degree`` = 1 (every rank gathers every expert of
a layer), 2 and 4. Each degree runs in fresh processes (peak RSS is per process), the degrees
alternating for ``--rounds`` rounds; each launch times ``--steps`` steps after one warm-up step
and reports the median. Bytes are counted by wrapping the collectives: FSDP's all-gathers and
reduce-scatters of the experts' group, and the expert-parallel all-to-alls (rows sent to other
ranks, forward and backward).
"""

import argparse
import statistics
import time

from bench_common import add_publish_args, collect_alternating, launch_workers, markdown_table, print_result, publish

DEGREES = (1, 2, 4)


def worker(args) -> None:
    import dataclasses
    import resource

    import torch
    import torch.distributed as dist

    from torchtitan_rl.data.sample import Sample
    from torchtitan_rl.distributed import expert_parallel
    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.distributed.utils import init_distributed
    from torchtitan_rl.engine import Engine, EngineOptions
    from torchtitan_rl.losses.router import RouterLossConfig
    from torchtitan_rl.models.qwen3.args import qwen3_flavors
    from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
    from torchtitan_rl.recipes.base import build_model

    rank, world, device = init_distributed(300)
    dims = ParallelDims(1, -1, 1, 1, world_size=world, ep=args.ep)
    dims.build_meshes("cpu")
    expert_group = dims.expert_mesh().get_group()
    moved = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
    counting = [False]

    def count_gather(collective, key):
        def wrapped(output, input, *rest, **kwargs):
            group = kwargs.get("group")
            if counting[0] and group is expert_group:
                size = dist.get_world_size(group)
                total = (output if key == "all_gather" else input).numel() * output.element_size()
                moved[key] += total * (size - 1) // size
            return collective(output, input, *rest, **kwargs)

        return wrapped

    dist.all_gather_single = count_gather(dist.all_gather_single, "all_gather")
    dist.reduce_scatter_single = count_gather(dist.reduce_scatter_single, "reduce_scatter")
    dispatch = expert_parallel.ExpertParallel._dispatch

    def counted_dispatch(self, module, inputs, mesh):
        x, tokens_per_expert = inputs
        sent = tokens_per_expert.view(mesh.size(), -1).sum(1)
        if counting[0]:
            # Rows to other ranks, there (dispatch) and back (combine), again in backward.
            remote = int(sent.sum() - sent[mesh.get_local_rank()])
            moved["all_to_all"] += 4 * remote * x.shape[1] * x.element_size()
        return dispatch(self, module, inputs, mesh)

    expert_parallel.ExpertParallel._dispatch = counted_dispatch

    model_args = dataclasses.replace(
        qwen3_flavors["debugmodel_moe"],
        dim=args.dim,
        num_experts=args.experts,
        moe_hidden_dim=args.expert_hidden,
        attn_backend="sdpa_loop",
    )
    model = build_model(model_args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32)
    optimizer = build_optimizer(model, 1e-5, 0.9, 0.95, 1e-8, 0.0)
    scheduler = build_lr_scheduler(optimizer, 10**6, 0, "linear", 0.0)
    options = EngineOptions(
        reduction="token_mean",
        horizon=1,
        max_tokens_per_microbatch=args.tokens,
        logits_chunk_size=1024,
        max_norm=1.0,
        router=RouterLossConfig(aux_loss_coef=0.01, aux_loss_scope="sequence"),
    )
    engine = Engine(
        model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options
    )
    gen = torch.Generator().manual_seed(rank)
    samples = []
    for _ in range(args.microbatches):
        ids = torch.randint(0, 500, (args.tokens + 1,), generator=gen)
        samples.append(Sample(input_ids=ids[:-1], labels=ids[1:], loss_mask=torch.ones(args.tokens, dtype=torch.bool)))
    times = []
    for step in range(args.steps + 1):
        counting[0] = step == 1  # one step's bytes, after the warm-up
        dist.barrier()
        start = time.perf_counter()
        engine.forward_backward(samples)
        engine.optim_step()
        dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - start)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    traffic = torch.tensor([float(v) for v in moved.values()])
    dist.all_reduce(traffic)  # summed over ranks, reported per rank below
    if rank == 0:
        expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        print_result(
            {
                "step_s": statistics.median(times),
                "peak_rss_gib": float(peak),
                "expert_params": expert_params,
                **{key: float(value) / world for key, value in zip(moved, traffic)},
            }
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-hidden", type=int, default=512)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches (one sequence each) per rank")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per launch (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=2)
    add_publish_args(parser, "expert_parallel")
    parser.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    shared = [
        *("--experts", str(args.experts), "--expert-hidden", str(args.expert_hidden), "--dim", str(args.dim)),
        *("--microbatches", str(args.microbatches), "--tokens", str(args.tokens), "--steps", str(args.steps)),
    ]

    def launch(ep: int):
        return lambda: launch_workers(__file__, args.ranks, [*shared, "--ep", str(ep)])

    runs = collect_alternating({ep: launch(ep) for ep in DEGREES}, args.rounds)
    for ep, results in runs.items():
        for result in results:
            if "error" in result:
                raise SystemExit(f"ep {ep}: the ranks failed: {result['error']}")
    step = {ep: statistics.median(r["step_s"] for r in results) for ep, results in runs.items()}
    peak = {ep: max(r["peak_rss_gib"] for r in results) for ep, results in runs.items()}
    first = {ep: results[0] for ep, results in runs.items()}
    mib = 2**20
    rows = [
        [
            ep,
            f"{step[ep]:.2f} s ({step[ep] / step[1]:.2f}x)",
            f"{peak[ep]:.2f} GiB ({peak[ep] / peak[1]:.2f}x)",
            f"{first[ep]['all_gather'] / mib:.1f}",
            f"{first[ep]['reduce_scatter'] / mib:.1f}",
            f"{first[ep]['all_to_all'] / mib:.1f}",
        ]
        for ep in DEGREES
    ]
    body = [
        f"`debugmodel_moe` widened to {args.experts} experts (hidden {args.expert_hidden}, dim {args.dim}; "
        f"{first[1]['expert_params'] / 1e6:.1f}M expert parameters in 3 MoE layers), top-2, {args.ranks} gloo "
        f"ranks with FSDP over all of them, {args.microbatches} micro-batches of {args.tokens} tokens per rank, "
        f"sequence-scope load balancing. Step time: median over {args.rounds} launches per degree (alternating) "
        f"of the median of {args.steps} steps; peak RSS: the largest rank's; bytes: what one rank sends to "
        "others in one step, averaged over the ranks (the experts' FSDP all-gathers and reduce-scatters; the "
        "all-to-alls of dispatch and combine, forward and backward).",
        "",
        *markdown_table(
            [
                "expert_parallel_degree",
                "step time",
                "peak RSS per rank",
                "experts all-gather MiB",
                "experts reduce-scatter MiB",
                "all-to-all MiB",
            ],
            rows,
        ),
    ]
    publish(
        args,
        "Expert parallel",
        "Step time, per-rank peak memory and bytes moved of `expert_parallel_degree` 1, 2 and 4 on 4 CPU ranks: "
        "tokens travel to their experts instead of every expert to every rank.",
        body,
    )


if __name__ == "__main__":
    main()
