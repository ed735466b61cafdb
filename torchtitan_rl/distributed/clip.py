"""Gradient clipping by the global norm over plain and sharded (DTensor) gradients."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip in place when ``max_norm > 0``; returns the pre-clip global norm (on device).

    Parameters may live on different meshes (a vision tower sharded over the FSDP mesh only,
    replicated over tensor parallel, beside a language model sharded over FSDP x TP), which
    ``get_total_norm`` refuses to mix. So the norm is taken per mesh: the norm of sharded
    gradients is a partial DTensor and ``full_tensor`` reduces it over that mesh's shards,
    giving every rank the norm of the whole gradient, with replicas counted once. The
    groups' norms then combine as the square root of their summed squares.
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
        return torch.zeros(())
    total_norm = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    if max_norm > 0:
        # As clip_grads_with_norm_ (which cannot take grads of several meshes at once).
        scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        for grads in groups.values():
            for grad in grads:
                grad.mul_(scale)
    return total_norm
