"""The global gradient norm and clipping by it, for every layout whose gradients stratagem clips
itself: plain gradients (one process, the DDP family), DTensor gradients on any meshes (FSDP2,
tensor parallel and their mixes) and pipeline stages whose ranks hold disjoint parameters. The
Lightning presets reach it through their strategy's ``clip_grad_norm``; FSDP1 and DeepSpeed clip
with their engine's own.
"""

from __future__ import annotations

from typing import Any


def clip_global_(params: list[Any], max_norm: float, groups: tuple[Any, ...] = ()) -> Any:
    """The global L2 norm of the gradients before clipping, over DTensor gradients on any
    meshes and plain ones, the squares summed over ``groups`` whose ranks hold disjoint
    parameters (pipeline stages); the gradients are clipped to ``max_norm`` when it is > 0. One
    mesh (or plain gradients) and no groups: exactly ``torch.nn.utils.clip_grad_norm_``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    by_mesh: dict[Any, list[Any]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        by_mesh.setdefault(key, []).append(g)
    if len(by_mesh) <= 1 and not groups:  # torch's own, as Lightning and Accelerate call it
        if not grads:
            return torch.zeros(())
        norm = (torch.nn.utils.clip_grad_norm_(params, max_norm) if max_norm > 0
                else torch.nn.utils.get_total_norm(grads, 2.0))
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for group in by_mesh.values():
        n = torch.nn.utils.get_total_norm(group, 2.0)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq = sq + n.float() ** 2
    for g in groups:
        dist.all_reduce(sq, group=g)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(float(coef) if isinstance(g, DTensor) else coef.to(g.dtype))
    return sq.sqrt()


__all__ = ["clip_global_"]
