"""Process-group start-up and the few collectives the training step needs."""

import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh


def init_distributed(init_timeout_seconds: int) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or run alone); returns (rank, world_size, device).

    On CUDA the default group carries both backends: NCCL for tensors on the GPU and gloo
    for the few host-side integers of the micro-batch plan, so agreeing on a plan never
    forces a GPU synchronization.
    """
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if "WORLD_SIZE" not in os.environ:
        return 0, 1, device
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=init_timeout_seconds))
    return dist.get_rank(), dist.get_world_size(), device


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
