"""Qwen3-MoE training steps on CPU, measured: the expert kernels, and what the router losses cost.

    .venv/bin/python scripts/benchmark_moe.py            # appends to docs/benchmarks.md
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
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmark_docs import publish  # noqa: E402


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
        routers = {"off": RouterLossConfig()} if impl == "loop" else {
            "off": RouterLossConfig(),
            "global": RouterLossConfig(aux_loss_coef=0.01, aux_loss_scope="global", z_loss_coef=0.001),
            "sequence": RouterLossConfig(aux_loss_coef=0.01, aux_loss_scope="sequence", z_loss_coef=0.001),
        }
        for name, router in routers.items():
            options = EngineOptions(reduction="token_mean", horizon=1, max_tokens_per_microbatch=args.tokens, logits_chunk_size=1024, max_norm=1.0, router=router)
            engines[f"{impl}/{name}"] = Engine(model, optimizer=optimizer, lr_scheduler=scheduler, parallel_dims=dims, device=device, options=options)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for round_ in range(args.repeats + 1):
        for name, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            engine.forward_backward(samples)
            engine.optim_step()
            dist.barrier()
            if round_ > 0:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        for name, values in times.items():
            print(f"RESULT {name} {statistics.median(values):.5f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches (one sequence each) per rank")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}", __file__,
           "--worker", "--microbatches", str(args.microbatches), "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    t = {line.split()[1]: float(line.split()[2]) for line in out.splitlines() if line.startswith("RESULT")}
    off = t["grouped_mm/off"]
    shown = "python scripts/benchmark_moe.py" + ("" if sys.argv[1:] == [] else " " + " ".join(sys.argv[1:]))
    lines = [
        f"## Qwen3-MoE on CPU ({datetime.date.today()})",
        "",
        f"Command: `{shown}` — machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}.",
        "",
        f"`debugmodel_moe` (8 experts, top-2), {args.ranks} FSDP gloo ranks, {args.microbatches} micro-batches of "
        f"{args.tokens} tokens per rank, median of {args.repeats} alternating rounds:",
        "",
        f"- Expert kernels, router losses off: `grouped_mm` {off * 1000:.0f} ms per step, per-expert `loop` "
        f"{t['loop/off'] * 1000:.0f} ms ({t['loop/off'] / off:.2f}x).",
        f"- Router losses (`grouped_mm`): global scope + z-loss {t['grouped_mm/global'] * 1000:.0f} ms "
        f"(+{(t['grouped_mm/global'] - off) / t['grouped_mm/global'] * 100:.0f} % of the step: the no-grad counting "
        f"pass over the {args.microbatches} micro-batches and one all-reduce of the counts); sequence scope + z-loss "
        f"{t['grouped_mm/sequence'] * 1000:.0f} ms (+{(t['grouped_mm/sequence'] - off) / t['grouped_mm/sequence'] * 100:.0f} %, "
        "one small all-reduce per micro-batch, no counting pass).",
    ]
    publish(lines, write=not args.no_write)


if __name__ == "__main__":
    main()
