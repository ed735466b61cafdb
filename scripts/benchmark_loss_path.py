"""Peak memory and time of the loss path: output head + log-probs + backward.

    .venv/bin/python scripts/benchmark_loss_path.py            # measure, append to docs/benchmarks.md
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
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

from benchmark_docs import publish

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
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
        print("RESULT " + json.dumps({"peak_gib": peak / 2**30, "seconds": seconds}), flush=True)


def launch(script: str, nproc: int, args: list[str], env: dict | None = None, retries: int = 1) -> dict:
    """Run ``script --worker ARGS`` in ``nproc`` fresh torchrun processes; the dict its rank 0
    printed on a ``RESULT {json}`` line, or ``{"error": the most telling line of output}``.

    A failed launch is retried ``retries`` times (shared machines: a rendezvous port taken
    by another job, a transient gloo error), with a warning and the output's tail on stderr.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(script), "--worker", *args]
    for attempt in range(retries + 1):
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode == 0 and lines:
            return json.loads(lines[0][len("RESULT "):])
        output = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        # torchrun's own summary ("ChildFailedError") names no cause; prefer the worker's error.
        errors = [line for line in output if ("Error" in line or "error:" in line) and "ChildFailedError" not in line]
        output = [line for line in output if line.strip("=")]
        error = (errors or output or [f"exit status {proc.returncode}"])[-1][-300:]
        if attempt < retries:
            tail = "\n".join(output[-40:])
            print(f"warning: {' '.join(cmd[3:])} failed ({error}); retrying. Output's tail:\n{tail}",
                  file=sys.stderr, flush=True)
    return {"error": error}


def run_config(tokens: int, dim: int, vocab: int, chunk: int, tp: int, variant: str) -> dict:
    return launch(__file__, tp, [f"--tokens={tokens}", f"--dim={dim}", f"--vocab={vocab}", f"--chunk={chunk}",
                                 f"--variant={variant}"])


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
    parser.add_argument("--dim", type=int, default=256, help="model dim (Qwen3-0.6B: 1024; smaller keeps CPU runs short)")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; figures are their means")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = parser.parse_args()
    if args.worker:
        worker(args.tokens, args.dim, args.vocab, args.chunk, args.variant)
        return

    configs = [("full", 1), ("chunked", 1), ("chunked", 2)]
    results: dict[tuple[str, int], list[dict]] = {config: [] for config in configs}
    for _ in range(args.rounds):
        for variant, tp in configs:
            results[(variant, tp)].append(run_config(args.tokens, args.dim, args.vocab, args.chunk, tp, variant))
    means = {config: _mean(runs) for config, runs in results.items()}
    full = means[("full", 1)]

    def fmt(r):
        return r["error"] if "error" in r else f"{r['peak_gib']:.2f} GiB, {r['seconds']:.2f} s"

    def ratio(r, key):
        return "—" if "error" in r or "error" in full else f"{r[key] / full[key]:.2f}"

    on_cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if on_cuda else f"CPU ({os.cpu_count()} cores, gloo)"
    lines = [
        f"## Loss path without recompute, {datetime.date.today().isoformat()} ({device}, torch {torch.__version__}, "
        f"{platform.machine()})",
        "",
        f"Command: `.venv/bin/python scripts/benchmark_loss_path.py` — output head + log-probs + backward, "
        f"{args.tokens} tokens, vocab {args.vocab}, dim {args.dim}, chunk {args.chunk} tokens; per-rank peak memory "
        f"of the loss path ({'allocator peak' if on_cuda else 'peak RSS growth'}) and time of one forward+backward, "
        f"means of {args.rounds} alternating rounds in fresh processes.",
        "",
        "| variant | tp | per-rank peak, time | memory / full | time / full |",
        "|---|---|---|---|---|",
    ]
    for (variant, tp), r in means.items():
        name = "full logits (`F.cross_entropy`)" if variant == "full" else "chunked (`token_loss`)"
        lines.append(f"| {name} | {tp} | {fmt(r)} | {ratio(r, 'peak_gib')} | {ratio(r, 'seconds')} |")
    lines.append("")
    publish(lines, write=not args.no_write)


if __name__ == "__main__":
    main()
