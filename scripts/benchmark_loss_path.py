"""Peak memory and time of the loss path: output head + log-probs + backward.

    .venv/bin/python scripts/benchmark_loss_path.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_loss_path.py --no-write

Each measurement runs in fresh processes (``torchrun``, gloo on CPU, NCCL on CUDA) so peaks
do not leak between them, and the variants alternate (two rounds) so that load on a shared
machine hits them alike. The loss path starts from this rank's final hidden states (its
sequence-parallel shard under tensor parallel) and the output weight (its vocabulary shard)
and ends after backward.

- chunked: ``losses.logprobs.token_loss`` (what training runs): per chunk of tokens, logits,
  log-probs, and the chunk's gradient taken at once, nothing recomputed;
- full logits: ``F.cross_entropy`` on the whole ``[T, V]`` logits (one rank), the baseline.

Peak memory is the rank's peak RSS growth during the loss path on CPU, and the allocator's
peak above the inputs on CUDA; time is one forward+backward after a warm-up.
"""

import argparse
import os
import resource
import time

import torch

from bench_common import add_publish_args, collect_alternating, launch_workers, markdown_table, print_result, publish

VOCAB = 151936  # Qwen3


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(tokens: int, dim: int, vocab: int, chunk: int, variant: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.distributed.utils import init_distributed
    from torchtitan_rl.losses.logprobs import token_loss

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))
    rank, world_size, device = init_distributed(600)
    dims = ParallelDims(1, 1, 1, world_size, world_size)
    dims.build_meshes(device.type)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(rank)
    hidden = torch.randn(tokens // world_size, dim, generator=gen, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab // world_size, dim, generator=gen, device=device, dtype=dtype) * dim**-0.5
    weight.requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)
    assert variant == "chunked" or world_size == 1, "the full-logits baseline runs on one rank"

    def step():
        hidden.grad = weight.grad = None  # every step allocates its gradients anew
        if variant == "full":
            loss = F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="sum")
        else:
            loss = token_loss(hidden, weight, labels, chunk, lambda start, end, lp, _: -lp.sum(), dims.mesh("tp"))[0]
        loss.backward()

    # On CPU the process's peak RSS only grows, so its growth over the RSS with the inputs
    # in place covers the warm-up and the timed step alike.
    cpu_base = _current_rss_bytes()
    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        cuda_base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - cuda_base
    else:
        peak = _peak_rss_bytes() - cpu_base
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        print_result({"peak_gib": peak / 2**30, "seconds": seconds})


def run_config(tokens: int, dim: int, vocab: int, chunk: int, tp: int, variant: str) -> dict:
    return launch_workers(
        __file__,
        tp,
        [f"--tokens={tokens}", f"--dim={dim}", f"--vocab={vocab}", f"--chunk={chunk}", f"--variant={variant}"],
    )


def _mean(results: list[dict]) -> dict:
    errors = [r for r in results if "error" in r]
    if errors:
        return errors[0]
    return {key: sum(r[key] for r in results) / len(results) for key in ("peak_gib", "seconds")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=("chunked", "full"), default="chunked", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument(
        "--dim", type=int, default=256, help="model dim (Qwen3-0.6B: 1024; smaller keeps CPU runs short)"
    )
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; figures are their means")
    add_publish_args(parser, "loss_path")
    args = parser.parse_args()
    if args.worker:
        worker(args.tokens, args.dim, args.vocab, args.chunk, args.variant)
        return

    configs = [("full", 1), ("chunked", 1), ("chunked", 2)]
    results = collect_alternating(
        {
            config: (
                lambda config=config: run_config(args.tokens, args.dim, args.vocab, args.chunk, config[1], config[0])
            )
            for config in configs
        },
        args.rounds,
    )
    means = {config: _mean(runs) for config, runs in results.items()}
    full = means[("full", 1)]

    def fmt(r):
        return r["error"] if "error" in r else f"{r['peak_gib']:.2f} GiB, {r['seconds']:.2f} s"

    def ratio(r, key):
        return "—" if "error" in r or "error" in full else f"{r[key] / full[key]:.2f}"

    on_cuda = torch.cuda.is_available()
    rows = [
        [
            "full logits (`F.cross_entropy`)" if variant == "full" else "chunked (`token_loss`)",
            tp,
            fmt(r),
            ratio(r, "peak_gib"),
            ratio(r, "seconds"),
        ]
        for (variant, tp), r in means.items()
    ]
    body = [
        (
            f"Output head + log-probs + backward, {args.tokens} tokens, vocab {args.vocab}, dim {args.dim}, chunk "
            f"{args.chunk} tokens; per-rank peak memory of the loss path "
            f"({'allocator peak' if on_cuda else 'peak RSS growth'}) and time of one forward+backward, means of "
            f"{args.rounds} alternating rounds in fresh processes."
        ),
        "",
        *markdown_table(["variant", "tp", "per-rank peak, time", "memory / full", "time / full"], rows),
    ]
    publish(
        args,
        "Loss path memory and time",
        "The chunked loss path (`token_loss`, alone and vocab-parallel over "
        "tp=2) against full logits (`F.cross_entropy`): per-rank peak memory and time.",
        body,
    )


if __name__ == "__main__":
    main()
