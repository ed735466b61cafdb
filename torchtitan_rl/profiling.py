"""Memory profiling of chosen training steps, one file per rank and step.

CUDA: an allocator snapshot (``*_memory_snapshot.pickle``; drag it into
https://pytorch.org/memory_viz). CPU has no caching allocator that keeps a history, so the
step runs under the PyTorch profiler with ``profile_memory=True`` and its allocation events
become a timeline (``*_memory_timeline.json``, see ``cpu_memory_timeline``).

The profiler's own ``export_memory_timeline`` is not used on CPU: it is deprecated, needs
``with_stack=True`` (stopping the profiler then took ~25 s for one debug-model step on two
ranks), and its data-flow analysis failed with an AssertionError on FSDP2 steps.

Profiling never stops a run: a file that cannot be written is a warning naming the path.
"""

import contextlib
import json
import logging
import os
from collections.abc import Iterator

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from torchtitan_rl.config.job_config import Profiling
from torchtitan_rl.distributed.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)


def _local_rank(mesh) -> int:
    return 0 if mesh is None else mesh.get_local_rank()


class MemoryProfiler:
    """``with profiler.step(n):`` around a training step records it if ``n`` is listed."""

    def __init__(
        self, config: Profiling, dump_folder: str, parallel_dims: ParallelDims, rank: int, device: torch.device
    ):
        self.enabled = config.enable_memory_snapshot
        self.steps = set(config.memory_snapshot_steps)
        self.max_entries = config.memory_snapshot_max_entries
        self.folder = os.path.join(dump_folder, config.save_memory_snapshot_folder)
        self.cuda = device.type == "cuda"
        self.rank = rank
        self.name = (
            f"rank{rank}_dp{parallel_dims.batch_rank()}_cp{_local_rank(parallel_dims.mesh('cp'))}"
            f"_tp{_local_rank(parallel_dims.mesh('tp'))}"
        )
        if self.enabled and not self.cuda and rank == 0:
            logger.info(
                "memory snapshots need the CUDA caching allocator; on %s, steps %s are recorded "
                "with the PyTorch profiler instead and written as timelines of the bytes each step "
                "allocates (*_memory_timeline.json) under %s",
                device.type,
                sorted(self.steps),
                self.folder,
            )

    def path(self, step: int) -> str:
        suffix = "memory_snapshot.pickle" if self.cuda else "memory_timeline.json"
        return os.path.join(self.folder, f"step_{step}", f"{self.name}_{suffix}")

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if not self.enabled or step not in self.steps:
            yield
            return
        record = self._record_cuda if self.cuda else self._record_cpu
        with record(self.path(step)):
            yield

    @contextlib.contextmanager
    def _record_cuda(self, path: str) -> Iterator[None]:
        if not self._try(
            "start recording", path, torch.cuda.memory._record_memory_history, max_entries=self.max_entries
        ):
            yield
            return
        try:
            yield
            self._write(path, _dump_cuda_snapshot, path)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    @contextlib.contextmanager
    def _record_cpu(self, path: str) -> Iterator[None]:
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        if not self._try("start the profiler for", path, prof.start):
            yield
            return
        try:
            yield
        finally:
            prof.stop()
        self._write(path, _write_cpu_timeline, prof, path)

    def _write(self, path: str, fn, *args) -> None:
        if self._try("write", path, fn, *args):
            logger.info("rank %d: wrote memory profile %s", self.rank, path)

    def _try(self, action: str, path: str, fn, *args, **kwargs) -> bool:
        try:
            fn(*args, **kwargs)
        except Exception as err:  # profiling must never end the run, whatever torch raises
            logger.warning(
                "rank %d: could not %s memory profile %s: %s: %s", self.rank, action, path, type(err).__name__, err
            )
            return False
        return True


def _dump_cuda_snapshot(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.cuda.memory._dump_snapshot(path)


def cpu_memory_timeline(prof: profile) -> dict:
    """The bytes allocated on the CPU while ``prof`` ran and not yet freed, after each event.

    Memory that existed before the profiler started (parameters, optimizer state of earlier
    steps) is not included: its size is unknown to the profiler, so its frees are skipped.
    """
    results = prof.profiler.kineto_results
    events, stack = [], list(results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    events.sort()
    live: dict[int, int] = {}
    allocated, times, sizes = 0, [], []
    for time_ns, ptr, size in events:
        if size > 0:
            live[ptr] = size
            allocated += size
        elif ptr in live:
            allocated -= live.pop(ptr)
        else:
            continue
        times.append(time_ns - results.trace_start_ns())
        sizes.append(allocated)
    return {
        "device": "cpu",
        "description": "bytes allocated during the step and still alive, after each allocation or free "
        "(memory from before the step is not counted); time_ns since the profiler started",
        "time_ns": times,
        "allocated_bytes": sizes,
        "peak_allocated_bytes": max(sizes, default=0),
        "allocated_bytes_at_end": allocated,
    }


def _write_cpu_timeline(prof: profile, path: str) -> None:
    timeline = cpu_memory_timeline(prof)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(timeline, f)
