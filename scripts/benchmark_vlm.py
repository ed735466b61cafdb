"""Vision-language training on CPU, measured: the shapes recipe's step time and per-rank peak
memory, its colour accuracy over several seeds, and what DP compute balancing does for the
slowest rank on very uneven images.

    .venv/bin/python scripts/benchmark_vlm.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_vlm.py --no-write # print only

1. ``train.py`` with ``train_configs/vlm_shapes.toml`` on ``--ranks`` gloo ranks for ``--steps``
   steps, logging every step: step time (the step's tokens over the logged per-rank
   throughput) and peak RSS per rank, medians over the steps after the first 5.
2. The recipe run in full (its ``training.steps``) for each of ``--seeds``, exported in HF
   format, then ``scripts/eval_vlm_shapes.py`` on 60 fresh colour questions (chance 1/6):
   the calibration of tests/integration/test_vlm.py.
3. ``Engine.forward_backward`` + ``optim_step`` of the ``debugmodel`` VLM on 2 FSDP ranks, on a
   global batch where two samples carry four large images each and the rest are short text:
   the contiguous split puts both on one rank. Balancing off and on alternate for ``--repeats``
   rounds; FSDP's collectives make every rank wait for the slowest, so rank 0's step time is
   the slowest rank's. Also the cost model's max/mean rank cost of both splits.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import (
    ROOT,
    add_publish_args,
    alternating_order,
    launch_workers,
    print_result,
    publish,
    ratio,
    run_train,
)

RECIPE = "train_configs/vlm_shapes.toml"


def recipe_figures(ranks: int, steps: int) -> dict:
    scalars = run_train(
        ["--job.config_file", RECIPE, "--training.steps", str(steps), "--metrics.log_freq", "1"], ranks=ranks
    ).scalars
    later = range(6, steps + 1)
    step_s = [scalars["tokens/total"][s] / (scalars["throughput(tps)"][s] * ranks) for s in later]
    return {
        "step_s": statistics.median(step_s),
        "rss_gib": max(scalars["memory/peak_rss(GiB)"][s] for s in later),
        "tokens": statistics.median(scalars["tokens/total"][s] for s in later),
        "images": scalars["data/num_images"][steps] / steps,
    }


def accuracy(seed: int, ranks: int) -> tuple[float, float, float]:
    """(first loss, last loss, colour accuracy) of the recipe trained with ``seed``."""
    with tempfile.TemporaryDirectory() as dump:
        run = run_train(
            [
                "--job.config_file",
                RECIPE,
                "--debug.seed",
                str(seed),
                "--checkpoint.enable",
                "true",
                "--checkpoint.last_save_model_only",
                "true",
                "--checkpoint.last_save_in_hf",
                "true",
            ],
            ranks=ranks,
            dump_folder=dump,
        )
        (export,) = os.listdir(os.path.join(dump, "checkpoint"))
        out = subprocess.run(
            [
                sys.executable,
                "scripts/eval_vlm_shapes.py",
                os.path.join(dump, "checkpoint", export),
                "--questions",
                "60",
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    first, last = run.first_last("loss_metrics/global_avg_loss")
    return first, last, json.loads(out.splitlines()[-1])["colour_accuracy"]


def balance_worker(repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan_rl.data.balance import assign_to_ranks, contiguous_split, imbalance
    from torchtitan_rl.data.sample import Sample, SampleImage
    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.distributed.utils import init_distributed
    from torchtitan_rl.engine import Engine, EngineOptions
    from torchtitan_rl.models.vlm.args import vlm_flavors
    from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
    from torchtitan_rl.recipes.base import balance_cost_model, build_model, vision_packing

    rank, world, device = init_distributed(300)
    dims = ParallelDims(1, -1, 1, 1, world_size=world)
    dims.build_meshes("cpu")
    args = vlm_flavors["debugmodel"]
    model = build_model(args, parallel_dims=dims, device=device, seed=0, param_dtype=torch.float32)
    optimizer = build_optimizer(model, 1e-4, 0.9, 0.95, 1e-8, 0.0)
    options = EngineOptions(
        reduction="token_mean",
        horizon=1,
        max_tokens_per_microbatch=0,
        logits_chunk_size=1024,
        max_norm=1.0,
        vision=vision_packing(args),
    )
    engine = Engine(
        model,
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(optimizer, 10**6, 0, "linear", 0.0),
        parallel_dims=dims,
        device=device,
        options=options,
    )
    gen = torch.Generator().manual_seed(0)
    side, merge = 16, args.spatial_merge_size  # 16 x 16 patches (224 px): 64 image tokens
    samples = []
    for i in range(8):
        num_images = 4 if i in (0, 1) else 0
        per_image = (side // merge) ** 2
        n = 96 + num_images * per_image
        rows = torch.full((n,), -1)
        rows[8 : 8 + num_images * per_image] = torch.arange(num_images * per_image)
        images = [
            SampleImage(torch.randn(side * side, args.vision.patch_dim, generator=gen), side, side)
            for _ in range(num_images)
        ]
        samples.append(
            Sample(
                input_ids=torch.randint(0, 250, (n,), generator=gen),
                labels=torch.randint(0, 250, (n,), generator=gen),
                loss_mask=torch.arange(n) >= 8 + num_images * per_image,
                images=images or None,
                vision_rows=rows if images else None,
            )
        )
    cost_model = balance_cost_model(args)  # the recipes' balancing, by this model's widths
    costs = [cost_model.sample_cost(len(s), s.num_patches) for s in samples]
    balanced = assign_to_ranks(
        [len(s) for s in samples], world, num_patches=[s.num_patches for s in samples], cost_model=cost_model
    )
    splits = {"off": contiguous_split(len(samples), world), "on": balanced}
    times: dict[str, list[float]] = {"off": [], "on": []}
    # Alternating like bench_common.time_alternating, with barriers so that every rank times the
    # same step.
    for round_, order in enumerate(alternating_order(list(splits), repeats + 1)):
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            engine.forward_backward([samples[i] for i in splits[name][rank]])
            engine.optim_step()
            dist.barrier()
            if round_ > 0:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        print_result(
            {name: (statistics.median(times[name]), imbalance(costs, split)) for name, split in splits.items()}
        )
    dist.destroy_process_group()


def balance_figures(repeats: int) -> dict:
    figures = launch_workers(__file__, 2, ["--repeats", str(repeats)])
    if "error" in figures:
        raise SystemExit(f"the balancing ranks failed: {figures['error']}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seeds", default="42,1,2,3", help="seeds of the accuracy runs (42 is the recipe's)")
    add_publish_args(parser, "vlm")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        balance_worker(args.repeats)
        return
    recipe = recipe_figures(args.ranks, args.steps)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    accuracies = {seed: accuracy(seed, args.ranks) for seed in seeds}
    balance = balance_figures(args.repeats)
    off, on = balance["off"], balance["on"]
    body = [
        (
            f"- `vlm_shapes.toml` on {args.ranks} gloo ranks (debugmodel VLM, 16 samples/step, "
            f"~{recipe['images']:.1f} images and {recipe['tokens']:.0f} tokens per step): median step "
            f"{recipe['step_s'] * 1000:.0f} ms, peak RSS {recipe['rss_gib']:.2f} GiB per rank (steps 6-{args.steps})."
        ),
        (
            f"- The recipe's full run on {args.ranks} ranks, colour accuracy on 60 fresh questions (chance 0.17), "
            "by seed: "
            + ", ".join(
                f"{seed}: loss {first:.2f} → {last:.2f}, accuracy {acc:.2f}"
                for seed, (first, last, acc) in accuracies.items()
            )
            + "."
        ),
        (
            f"- DP compute balancing, 2 FSDP ranks, two samples with 4 images of 16x16 patches each plus six "
            f"text samples: slowest-rank step {off[0] * 1000:.0f} ms contiguous vs {on[0] * 1000:.0f} ms balanced "
            f"({ratio(off[0], on[0])}); cost-model max/mean rank cost {off[1]:.2f} vs {on[1]:.2f} "
            f"(median of {args.repeats} alternating rounds)."
        ),
    ]
    publish(
        args,
        "Vision-language training",
        "Step time and memory of the `vlm_shapes.toml` recipe, its colour "
        "accuracy over several seeds, and what DP compute balancing saves on uneven images.",
        body,
    )


if __name__ == "__main__":
    main()
