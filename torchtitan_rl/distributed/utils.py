"""Process-group start-up and teardown, and the few collectives the training step needs."""

import datetime
import gc
import logging
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)


def init_distributed(init_timeout_seconds: int) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or run alone); returns (rank, world_size, device).

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
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=init_timeout_seconds))
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
