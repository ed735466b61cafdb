"""Gradient clipping by the global norm over plain and sharded (DTensor) gradients."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan_rl.distributed.utils import all_reduce


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None = None) -> torch.Tensor:
    """Clip in place when ``max_norm > 0``; returns the pre-clip global norm (on device).

    Parameters may live on different meshes (a vision tower sharded over the FSDP mesh only,
    replicated over tensor parallel, beside a language model sharded over FSDP x TP), which
    ``get_total_norm`` refuses to mix. So the norm is taken per mesh: the norm of sharded
    gradients is a partial DTensor and ``full_tensor`` reduces it over that mesh's shards,
    giving every rank the norm of the whole gradient, with replicas counted once. The
    groups' norms then combine as the square root of their summed squares, summed over
    ``pp_mesh`` too when pipeline stages hold the parameters (each its own).
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        total_norm = torch.zeros((), device=parameters[0].device if parameters else None)
    else:
        total_norm = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    if pp_mesh is not None:
        # Every stage takes part, even one without gradients.
        total_norm = all_reduce(total_norm.square(), "sum", pp_mesh).sqrt()
    if max_norm > 0:
        # As clip_grads_with_norm_ (which cannot take grads of several meshes at once).
        scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        for grads in groups.values():
            for grad in grads:
                grad.mul_(scale)
    return total_norm
