"""Peak bytes of live torch CPU tensors per rank over a whole ``train.py`` run.

    torchrun --nproc_per_node N scripts/measure_memory.py --out DIR -- <train.py arguments>
    python scripts/measure_memory.py --out DIR -- <train.py arguments>        (one process)

Each rank runs ``train.main(argv)`` (model build, data, steps, close) under the PyTorch
profiler (CPU, ``profile_memory=True``), started before the run's modules are imported, and
writes ``DIR/rank{R}.json``: ``peak_bytes``, ``exit_status`` (also this script's), ``rank``,
``world_size``, ``live_bytes_at_end`` (~0: what outlived the run), and the live bytes at each
optimizer step's start and end (from the first step's end the optimizer state exists: about the
static part; the peak minus it is the transient part).

The live bytes are the CPU allocator's own count (c10's ``caffe2_report_cpu_memory_usage``
switched on), carried by every allocation event of the profiled thread: it includes blocks
allocated or freed by the other threads (data prefetch, gloo's workers), whose events the
profiler does not record. ``main_thread_peak_bytes`` is the peak of
``torchtitan_rl.profiling.cpu_memory_timeline`` (the main thread's own events, frees matched by
pointer; a block that another thread frees stays counted there).

Counted: storage that torch's CPU allocator hands out (tensors, their gradients, optimizer
state, collectives' buffers). Not counted: memory from outside it (Python objects, gloo's own
buffers, the interpreter, libraries, numpy arrays, memory-mapped files) and tensors allocated
before the profiler started. ``measure(train_args, nproc, out_dir)`` launches this script.
"""

import argparse
import bisect
import ctypes
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _count_every_thread(torch) -> None:
    """Make the CPU allocator count every block of every thread (not only profiled ones)."""
    for lib in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
        ctypes.c_bool.in_dll(ctypes.CDLL(lib), "FLAGS_caffe2_report_cpu_memory_usage").value = True
        return
    raise RuntimeError("libc10 not found next to torch: cannot count the CPU allocator's bytes")


def _analyse(prof) -> tuple[list[int], list[dict]]:
    """The allocator's live bytes after each CPU allocation or free of the profiled thread, and
    at the start and end of every optimizer step (``Optimizer.step#...``)."""
    from torch._C._profiler import _EventType

    samples, steps, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            samples.append((event.start_time_ns, event.extra_fields.total_allocated))
        elif event.name.startswith("Optimizer.step#"):
            steps.append((event.start_time_ns, event.end_time_ns))
    samples.sort()
    times, sizes = [t for t, _ in samples], [s for _, s in samples]

    def live_at(t_ns: int) -> int:
        i = bisect.bisect_right(times, t_ns)
        return sizes[i - 1] if i else 0

    return sizes, [{"live_bytes_at_start": live_at(a), "live_bytes_at_end": live_at(b)} for a, b in sorted(steps)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for rank{R}.json")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args

    import torch
    from torch.profiler import ProfilerActivity, profile

    _count_every_thread(torch)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    try:
        sys.path.insert(0, ROOT)
        import train

        status = train.main(train_args)
    finally:
        prof.stop()
    from torchtitan_rl.profiling import cpu_memory_timeline

    sizes, optimizer_steps = _analyse(prof)
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "exit_status": status,
        "peak_bytes": max(sizes, default=0),
        "main_thread_peak_bytes": cpu_memory_timeline(prof)["peak_allocated_bytes"],
        "live_bytes_at_end": sizes[-1] if sizes else 0,
        "optimizer_steps": optimizer_steps,
        "train_args": train_args,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return status


def write_long_rows(path: str, num_rows: int = 128, seed: int = 0) -> str:
    """A JSONL file of ``{"text"}`` rows of about 2,000 bytes: longer than any debug recipe's
    ``training.seq_len``, so that every sample is truncated to exactly ``seq_len`` tokens (what a
    memory estimate assumes); returns ``path``."""
    import random

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_rows):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=300))}) + "\n")
    return path


def measure(train_args: list[str], nproc: int, out_dir: str, timeout: float = 600) -> list[dict]:
    """Run ``train.py TRAIN_ARGS`` under this script on ``nproc`` ranks (one process without a
    process group for 1, ``torchrun --standalone`` otherwise); the ``rank{R}.json`` dicts by rank.
    A failed launch raises RuntimeError with the tail of its stderr."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"rank{r}.json") for r in range(nproc)]
    for path in paths:  # stale files of an earlier run must not be read back
        if os.path.exists(path):
            os.remove(path)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*launcher, os.path.abspath(__file__), "--out", out_dir, "--", *train_args]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **env}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not all(os.path.exists(p) for p in paths):
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-40:])
        raise RuntimeError(f"measurement failed (exit status {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
