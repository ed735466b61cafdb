"""Per-rank peak memory of context parallel on ONE long packed sequence: the loss path and a
training step, at cp in {1, 2, 4}, for the CP-local loss and for a loss that all-gathers logits.

    .venv/bin/python scripts/benchmark_context_parallel.py            # rewrites its page in docs/benchmarks/
    .venv/bin/python scripts/benchmark_context_parallel.py --no-write
    .venv/bin/python scripts/benchmark_context_parallel.py --parts loss --cp 1 4 --no-write   # a subset

(A subset run that writes its page replaces the whole page's tables with the subset's.)

Every (part, cp) runs in fresh ``torchrun`` processes, one per CP rank (gloo on CPU, NCCL on
CUDA: one GPU per rank), which run the variants one after the other:

- ``local``: the library's CP-local loss: each rank computes the log-probs of its own zigzag
  share of the tokens with ``token_loss`` in chunks of ``--chunk`` tokens;
- ``local_unchunked``: the same code with one chunk holding all of the rank's tokens;
- ``gather``: the loss before CP-local losses (AReaL's old way): each rank computes its local
  logits ``[T/cp, V]``, all-gathers them over ``cp`` with an autograd all-gather (backward =
  reduce-scatter) into ``[T, V]``, computes the log-probs of every token from the full logits
  (same math as the unchunked path) and keeps its own tokens' terms, so gradients are exact.

Parts:

- ``loss``: from this rank's final hidden states ``[T/cp, dim]`` and the (replicated) output
  weight ``[V, dim]`` through log-probs and backward;
- ``step``: ``Engine.forward_backward`` + ``optim_step`` on a ``debugmodel`` Qwen3 with the
  chosen vocabulary and ``sdpa_loop`` attention by default (parameters FSDP-sharded over cp, as the
  library does); ``gather`` replaces the engine's ``_token_losses`` in the worker.

Peak memory is per rank, the largest over the CP ranks, of the measured step (after one
warm-up step): on CPU the peak of the bytes allocated during the step and still alive
(PyTorch profiler allocation events, ``torchtitan_rl.profiling.cpu_memory_timeline``; memory
that existed before the step, parameters and optimizer state, is not counted); on CUDA
``torch.cuda.max_memory_allocated`` above the memory allocated before the step. The time is
that of the same (profiled) step, the slowest rank's.
"""

import argparse
import gc
import os
import sys
import time
from dataclasses import replace

import torch

from bench_common import add_publish_args, launch_workers, markdown_table, print_result, publish

VARIANTS = ("local", "local_unchunked", "gather")
PARTS = ("loss", "step")
# Per-rank peak of the gather variant in units of T * V * 4 bytes (measured: 3.0 at cp=1,
# 3.5 at cp=2 — gathered logits, their shifted copy, exp, the local logits), plus what one
# worker process holds besides; used to skip runs that cannot fit in this machine's memory.
GATHER_PEAK_FACTOR = 3.6
WORKER_OVERHEAD_BYTES = 2**29


def _measure(step, device: torch.device) -> tuple[int, float]:
    """(peak bytes allocated during ``step()`` above what was allocated before, seconds)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device) - base, time.perf_counter() - start
    from torch.profiler import ProfilerActivity, profile

    from torchtitan_rl.profiling import cpu_memory_timeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    return cpu_memory_timeline(prof)["peak_allocated_bytes"], seconds


def _gathered_logprobs(hidden, weight, labels, cp_mesh):
    """Log-probs of this rank's tokens, computed from logits all-gathered over ``cp``."""
    from torchtitan_rl.compat import all_gather, all_gather_autograd

    logits = hidden @ weight.t()
    rank = 0
    if cp_mesh is not None:
        rank = cp_mesh.get_local_rank()
        logits = all_gather_autograd(logits, cp_mesh)  # [T, V], in rank order
        labels = all_gather(labels, cp_mesh)
    logprobs = logits.float().log_softmax(-1).gather(1, labels[:, None])[:, 0]
    n = hidden.shape[0]
    # Only this rank's rows carry gradient; the gather's reduce-scatter hands each rank its own.
    return logprobs[rank * n : (rank + 1) * n]


def _loss_step(args, variant, dims, device):
    from torchtitan_rl.losses.logprobs import token_loss

    cp_mesh = dims.mesh("cp")
    rank = 0 if cp_mesh is None else cp_mesh.get_local_rank()
    local_tokens = args.tokens // dims.cp
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(rank)
    hidden = torch.randn(local_tokens, args.dim, generator=gen, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(args.vocab, args.dim, generator=gen, device=device, dtype=dtype) * args.dim**-0.5
    weight.requires_grad_()
    labels = torch.randint(0, args.vocab, (local_tokens,), generator=gen, device=device)
    chunk = local_tokens if variant == "local_unchunked" else args.chunk

    def step():
        hidden.grad = weight.grad = None  # every step allocates its gradients anew
        if variant == "gather":
            loss = -_gathered_logprobs(hidden, weight, labels, cp_mesh).sum()
        else:
            loss = token_loss(hidden, weight, labels, chunk, lambda start, end, lp, _: -lp.sum())[0]
        loss.backward()

    return step


def _train_step(args, variant, dims, device):
    from torch.distributed.tensor import DTensor

    from torchtitan_rl.data.sample import Sample
    from torchtitan_rl.engine import Engine, EngineOptions
    from torchtitan_rl.models.qwen3.args import qwen3_flavors
    from torchtitan_rl.optim import build_lr_scheduler, build_optimizer
    from torchtitan_rl.recipes.base import build_model

    model_args = replace(
        qwen3_flavors["debugmodel"],
        vocab_size=args.vocab,
        attn_backend=args.attn_backend,
        max_seq_len=max(args.tokens, qwen3_flavors["debugmodel"].max_seq_len),
    )
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(model_args, parallel_dims=dims, device=device, seed=0, param_dtype=param_dtype)
    optimizer = build_optimizer(model, 1e-4, 0.9, 0.95, 1e-8, 0.1)
    scheduler = build_lr_scheduler(optimizer, 100, 0, "linear", 0.0)
    autocast_dtype = param_dtype if (dims.fsdp_mesh() is None and param_dtype != torch.float32) else None
    chunk = args.tokens if variant == "local_unchunked" else args.chunk
    options = EngineOptions(
        reduction="token_mean", horizon=args.tokens, max_tokens_per_microbatch=0, logits_chunk_size=chunk, max_norm=1.0
    )
    engine = Engine(
        model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        parallel_dims=dims,
        device=device,
        options=options,
        autocast_dtype=autocast_dtype,
    )
    if variant == "gather":

        def gathered_token_losses(mb):
            with engine._autocast():
                hidden = engine.model(mb.input_ids, mb.positions, mb.seq_ids)
                weight = engine.model.output.weight
                weight = weight.to_local() if isinstance(weight, DTensor) else weight
                logprobs = _gathered_logprobs(hidden, weight, mb.labels, dims.mesh("cp"))
            return -logprobs

        engine._token_losses = gathered_token_losses
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.tokens + 1,), generator=gen).tolist()
    sample = Sample.from_tokens(tokens, [True] * len(tokens))  # one sequence of args.tokens

    def step():
        engine.forward_backward([sample])
        engine.optim_step()

    return step


def worker(args) -> None:
    import torch.distributed as dist

    from torchtitan_rl.distributed.parallel_dims import ParallelDims
    from torchtitan_rl.distributed.utils import init_distributed

    rank, world_size, device = init_distributed(1800)
    dims = ParallelDims(1, 1, world_size, 1, world_size)
    dims.build_meshes(device.type)
    results = {}
    for variant in args.variants:
        # One process runs every variant in turn: the measure counts only what the measured
        # step allocates, so nothing carries over from an earlier variant.
        step = (_loss_step if args.part == "loss" else _train_step)(args, variant, dims, device)
        step()  # warm-up (and the optimizer state, for the training step)
        peak, seconds = _measure(step, device)
        del step
        gc.collect()
        per_rank = [(peak, seconds)]
        if dist.is_initialized():
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, (peak, seconds))
        results[variant] = {
            "peak_gib": max(p for p, _ in per_rank) / 2**30,
            "peak_gib_per_rank": [p / 2**30 for p, _ in per_rank],
            "seconds": max(s for _, s in per_rank),
        }
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        print_result(results)


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run(part: str, cp: int, args, on_cuda: bool) -> dict:
    """{variant: result} of every chosen variant, run one after the other in ``cp`` fresh processes."""
    variants, skipped = list(args.variants), {}
    if "gather" in variants and not on_cuda:
        need = cp * (GATHER_PEAK_FACTOR * args.tokens * args.vocab * 4 + WORKER_OVERHEAD_BYTES)
        available = _available_bytes()
        if available is not None and need > 0.9 * available:
            variants.remove("gather")
            skipped["gather"] = {
                "error": f"not run: about {need / 2**30:.0f} GiB over {cp} ranks would not "
                f"fit ({available / 2**30:.0f} GiB available)"
            }
    worker_args = [
        f"--part={part}",
        "--variants",
        *variants,
        f"--tokens={args.tokens}",
        f"--dim={args.dim}",
        f"--vocab={args.vocab}",
        f"--chunk={args.chunk}",
        f"--attn-backend={args.attn_backend}",
    ]
    result = launch_workers(__file__, cp, worker_args) if variants else {}
    if "error" in result:
        result = {variant: result for variant in variants}
    print(f"  {part} cp={cp}: {result}", file=sys.stderr, flush=True)
    return {**result, **skipped}


def _fmt(r: dict) -> str:
    return r["error"] if "error" in r else f"{r['peak_gib'] * 1024:.0f} MiB, {r['seconds']:.1f} s"


def _ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or "error" in a or "error" in b or b["peak_gib"] == 0:
        return "—"
    return f"{a['peak_gib'] / b['peak_gib']:.2f}"


def table(part: str, results: dict, cps: list[int], args) -> list[str]:
    rows = []
    for cp in cps:
        row = {v: results.get((part, v, cp)) for v in VARIANTS}
        rows.append(
            [
                cp,
                args.tokens // cp,
                *(_fmt(row[v]) if row[v] else "not run" for v in VARIANTS),
                _ratio(row["local"], results.get((part, "local", 1))),
                _ratio(row["local_unchunked"], results.get((part, "local_unchunked", 1))),
                _ratio(row["local"], row["gather"]),
                _ratio(row["local_unchunked"], row["gather"]),
            ]
        )
    return markdown_table(
        [
            "cp",
            "tokens per rank",
            "CP-local, chunked",
            "CP-local, unchunked",
            "all-gather logits",
            "chunked cp/cp=1",
            "unchunked cp/cp=1",
            "chunked / all-gather",
            "unchunked / all-gather",
        ],
        rows,
    )


def target_lines(results: dict, cps: list[int]) -> list[str]:
    """The target set for CP-local losses: loss-path peak at the largest cp within 0.3x of cp=1, below all-gather."""
    top = 4
    if 1 not in cps or top not in cps:
        return []
    lines = []
    for part in ("loss", "step"):
        gather = results.get((part, "gather", top))
        for variant, name in (("local", "chunked"), ("local_unchunked", "unchunked")):
            r, base = results.get((part, variant, top)), results.get((part, variant, 1))
            ratio = _ratio(r, base)
            if ratio == "—":
                continue
            verdict = "within" if float(ratio) <= 0.3 else "NOT within"
            vs = _ratio(r, gather)
            vs_text = "" if vs == "—" else f"; {vs}x the all-gather variant's {gather['peak_gib'] * 1024:.0f} MiB"
            lines.append(f"- {part}, CP-local {name}: cp={top} / cp=1 = {ratio} ({verdict} the 0.3x target){vs_text}.")
    head = (
        f"Target (for the loss path: per-rank peak at cp={top} within 0.3x of cp=1 and below the "
        "all-gather variant; the training step is held to the same bar for comparison):"
    )
    return ([head, ""] + lines + [""]) if lines else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--cp", nargs="+", type=int, default=[1, 2, 4], help="context-parallel degrees (ranks)")
    parser.add_argument("--tokens", type=int, default=16384, help="length of the one packed sequence")
    parser.add_argument(
        "--dim", type=int, default=256, help="hidden size of the loss-path part (the step uses the debugmodel's 128)"
    )
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per loss chunk of the chunked path")
    parser.add_argument(
        "--attn-backend",
        default="sdpa_loop",
        choices=("sdpa_loop", "sdpa_dense", "flex"),
        help="attention of the training step (flex: CUDA only)",
    )
    add_publish_args(parser, "context_parallel")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for cp in args.cp:
        if args.tokens % (2 * cp):
            parser.error(f"--tokens ({args.tokens}) must divide by 2*cp ({2 * cp}) so that no padding is added")

    on_cuda = torch.cuda.is_available()
    if on_cuda and max(args.cp) > torch.cuda.device_count():
        parser.error(f"cp={max(args.cp)} needs as many GPUs; {torch.cuda.device_count()} visible")
    started = time.perf_counter()
    results = {}
    for part in args.parts:
        for cp in args.cp:
            for variant, result in run(part, cp, args, on_cuda).items():
                results[(part, variant, cp)] = result
    minutes = (time.perf_counter() - started) / 60

    if on_cuda:
        method = "allocator peak (`torch.cuda.max_memory_allocated`) above the memory allocated before the step"
    else:
        method = (
            "peak of the bytes allocated during the step and still alive, from the PyTorch profiler's "
            "allocation events (`profile_memory=True`, `torchtitan_rl.profiling.cpu_memory_timeline`; "
            "tensors that existed before the step, parameters and optimizer state, are not counted)"
        )
    body = [
        (
            f"{'NCCL, one GPU per rank' if on_cuda else 'gloo, one thread per rank'}; {minutes:.0f} min in all. One "
            f"packed sequence of {args.tokens} tokens split zigzag over cp ranks; vocab {args.vocab}; chunked = "
            f"{args.chunk}-token chunks, unchunked = one chunk holding every local token; all-gather logits = local "
            "logits all-gathered over cp (autograd) before an unchunked loss. Per-rank peak memory, the largest over "
            f"the cp ranks, of the step after one warm-up: {method}. Times are of that profiled step, slowest rank"
            + ("" if on_cuda else f"; with more ranks than the {os.cpu_count()} cores they share them")
            + "."
        ),
        "",
    ]
    if "loss" in args.parts:
        body += [f"Loss path (output head + log-probs + backward from the rank's hidden states, dim {args.dim}):", ""]
        body += table("loss", results, args.cp, args) + [""]
    if "step" in args.parts:
        body += [
            (
                f"Training step (`Engine.forward_backward` + `optim_step`, `debugmodel` Qwen3 with vocab "
                f"{args.vocab}, `{args.attn_backend}` attention, parameters FSDP-sharded over cp):"
            ),
            "",
        ]
        body += table("step", results, args.cp, args) + [""]
    body += target_lines(results, args.cp)
    publish(
        args,
        "Context parallel memory on one long sequence",
        "Per-rank peak memory and time of the loss path "
        "and of a training step at cp = 1, 2, 4: CP-local losses (chunked, unchunked) against all-gathered "
        "logits.",
        body,
    )


if __name__ == "__main__":
    main()
