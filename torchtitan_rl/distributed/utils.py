"""Process-group start-up and teardown, and the few collectives the training step needs."""

import contextlib
import datetime
import gc
import logging
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


def init_distributed(collective_timeout_seconds: int) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or run alone); returns (rank, world_size, device).
    ``collective_timeout_seconds`` is the default group's timeout, and so of every group built
    without one of its own: of the start-up and of every collective on them.

    On CUDA the default group carries both backends: NCCL for tensors on the GPU and gloo
    for the few host-side integers of the micro-batch plan, so agreeing on a plan never
    forces a GPU synchronization.
    """
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=collective_timeout_seconds))
    if backend == "gloo":
        # Gloo connects each pair of ranks during init; a rank that is done with its side may
        # fail a config check and exit while a peer still connects to it, which the peer then
        # reports as a crash ("connectFullMesh failed") instead of the check's error.
        dist.barrier()
    return dist.get_rank(), dist.get_world_size(), device


def shutdown_distributed(clean: bool) -> None:
    """Tear the process groups down while the interpreter is still whole; a no-op without any.

    Call it after everything that used the groups (trainer, meshes, models) is unreferenced
    and every asynchronous user of them (background checkpoint writes) has finished.
    ``clean``: every rank got here after finishing its work, so they meet at a barrier first
    (a rank that failed alone must not wait there for peers stuck elsewhere) and the gloo
    threads are checked to be gone.

    Why more than ``destroy_process_group``: a gloo group's worker thread still holds each
    collective for a moment after completing it; dropping it frees tensors whose Python
    objects need the GIL. If that happens during interpreter shutdown, the thread is
    terminated while unwinding C++ code and the process aborts ("terminate called without
    an active exception", SIGABRT) after the job finished. The group's destructor joins
    those threads, but ``destroy_process_group`` only forgets c10d's references: device
    meshes keep theirs, and DTensor's caches keep meshes alive until interpreter shutdown.
    So drop the meshes' references too and collect, which runs the destructors now.
    """
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()
    for obj in gc.get_objects():
        # A mesh's groups sit in a private registry (torch 2.13); where it is missing the
        # warning below tells that the groups outlived this function.
        # (type(), not isinstance(): that would read __class__ of every object, and some warn.)
        registry = getattr(obj, "_pg_registry", None) if issubclass(type(obj), DeviceMesh) else None
        if registry is not None:
            registry.clear()
    gc.collect()
    survivors = _gloo_thread_count() if clean else 0
    if survivors:
        logger.warning(
            "%d gloo threads outlive destroy_process_group() (something still references a process group); "
            "one finishing a collective during interpreter shutdown aborts the process",
            survivors,
        )


def _gloo_thread_count() -> int:
    """Live threads of gloo groups in this process (worker and transport threads, by the names
    torch and gloo give them); 0 where threads cannot be listed (not Linux)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    names = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(name in ("pt_gloo_runloop", "gloo_tcp_loop") for name in names)


def all_reduce(tensor: torch.Tensor, op: str, mesh: DeviceMesh | None) -> torch.Tensor:
    """Functional (on-device, no host sync) all-reduce; the identity on a single rank."""
    if mesh is None:
        return tensor
    return funcol.all_reduce(tensor, reduceOp=op, group=mesh)


def host_max(values: list[int], mesh: DeviceMesh | None) -> list[int]:
    """The element-wise largest of integers known on the host of every rank of ``mesh``
    (one small collective for all of them)."""
    if mesh is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return t.tolist()


def global_moments(values: torch.Tensor, mesh: DeviceMesh | None) -> tuple[int, float, float]:
    """``(count, mean, population variance)`` of ``values`` (1-D, any device) together with the
    values of every other rank of ``mesh`` (None: these alone), in float64. Two passes (the
    mean, then the squared deviations from it), so values far from 0 with a small spread keep
    their variance; the mean and variance of no values are 0."""
    values = values.detach().double().cpu()
    sums = torch.tensor([values.numel(), values.sum().item()], dtype=torch.float64)
    if mesh is not None:
        dist.all_reduce(sums, group=mesh.get_group())
    count = int(sums[0])
    mean = float(sums[1]) / count if count else 0.0
    squares = ((values - mean) ** 2).sum().reshape(1)
    if mesh is not None:
        dist.all_reduce(squares, group=mesh.get_group())
    return count, mean, float(squares) / count if count else 0.0


class PeerFailedError(RuntimeError):
    """Another rank failed where this one did not (``failures_shared``): the message names that
    rank and its error; its traceback is on that rank's stderr."""

    def __init__(self, rank: int, error: str):
        super().__init__(f"rank {rank} failed: {error}")
        self.rank, self.error = rank, error


@contextlib.contextmanager
def failures_shared(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run the block, then agree over ``group`` whether it failed on any rank: a rank whose
    block raised re-raises its own exception (traceback kept), every other rank raises a
    ``PeerFailedError`` naming a rank that failed and its error. So a failure on one rank
    (a user's environment or reward) ends the work of all of them here, not in their next
    collective at its timeout. The block must not wait on peers of ``group`` itself. One
    all-reduce of an integer when nothing failed; ``group`` None: this rank alone."""
    if group is None:
        yield
        return
    try:
        yield
    except Exception as err:
        _agree_on_failure(group, f"{type(err).__name__}: {err}")
        raise
    _agree_on_failure(group, None)


def _agree_on_failure(group: dist.ProcessGroup, error: str | None) -> None:
    num_failed = torch.tensor([error is not None], dtype=torch.int64)
    dist.all_reduce(num_failed, group=group)
    if num_failed.item() == 0:
        return
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if error is None:
        failed = [(dist.get_global_rank(group, i), e) for i, e in enumerate(errors) if e is not None]
        others = f" ({len(failed) - 1} more ranks failed too)" if len(failed) > 1 else ""
        raise PeerFailedError(failed[0][0], failed[0][1] + others)


def all_to_all_objects(outgoing: list[Any], mesh: DeviceMesh) -> list[Any]:
    """Rank r of ``mesh`` gets ``outgoing[r]`` of every rank, all at once: returns, per rank of
    ``mesh``, what it addressed to this one (this rank's own entry as it is). A None entry sends
    no bytes and arrives as None. Unlike an object all-gather, each object travels to its
    destination only. Two host collectives (the sizes, then the pickled bytes), on gloo also
    when the mesh is on CUDA."""
    group, rank = mesh.get_group(), mesh.get_local_rank()
    payloads = [b"" if obj is None or r == rank else pickle.dumps(obj) for r, obj in enumerate(outgoing)]
    sent_sizes = [len(payload) for payload in payloads]
    received_sizes = torch.empty(len(payloads), dtype=torch.int64)
    dist.all_to_all_single(received_sizes, torch.tensor(sent_sizes, dtype=torch.int64), group=group)
    sizes = received_sizes.tolist()
    joined = b"".join(payloads)
    sent = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    received = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.all_to_all_single(received, sent, sizes, sent_sizes, group=group)
    buffer = memoryview(received.numpy())
    out, start = [], 0
    for source, size in enumerate(sizes):
        if source == rank:
            out.append(outgoing[rank])
        else:
            out.append(pickle.loads(buffer[start : start + size]) if size else None)
        start += size
    return out


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly sharded) parameter: ``full_tensor()``, a collective, for a DTensor."""
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach()
