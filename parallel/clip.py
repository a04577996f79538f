"""The global gradient norm and clipping by it, for every layout whose gradients stratagem clips
itself: plain gradients (one process, the DDP family), DTensor gradients on any meshes (FSDP2,
tensor parallel and their mixes) and pipeline stages whose ranks hold disjoint parameters. The
Lightning presets reach it through their strategy's ``clip_grad_norm``, the Accelerate loop
through its builder's ``clip``; FSDP1 and DeepSpeed clip with their engine's own.

Every layout must measure the same number, or they clip by different coefficients and train
different models. On CPU torch's fp32 norm is not that number: ``torch.linalg.vector_norm``
accumulates a large tensor inexactly (an 8192 x 64 output head's gradient 3e-4 relative, 8M
random elements 2.6e-4), by an amount that depends on how the tensor is cut, so the whole model
(single, DDP), FSDP2's and TP's shards and DeepSpeed's own norm read norms up to 1e-4 apart: its
vectorized lanes each add thousands of squares to a growing fp32 sum, dropping their low bits.
Here a CPU tensor is viewed as rows of ``ROW`` elements, torch takes each row's norm in fp32 (a
short sum: exact to ~1e-7 at worst) and the rows' squares are summed in float64: every layout reads
the norm to ~1e-8 (a constant tensor, the worst case: 2e-7), as DeepSpeed's does, at torch's own
speed (gpt_small's 10.8M gradients on one thread: 3.4 ms, torch's 2.6 ms). Not chosen: each
32k-element piece's fp32 norm (our 8192-row output head's gradient still read 1e-5 low) and
``vector_norm(dtype=torch.float64)``, exact but 4x slower, converting its input first (whole:
twice the gradient's bytes).

On CUDA each tensor group's norm stays torch's fp32 foreach one (``get_total_norm``, what
``torch.nn.utils.clip_grad_norm_`` measures; with plain gradients the same number bit for bit):
float64 there would copy the input as well (4 GB for a 128k-vocabulary head's gradient), and the
rows would cost a kernel per tensor where foreach launches a few, plus their norms (1/256 of the
gradient's bytes). Neither that nor torch's CUDA accuracy was measured (no GPU here). Only the
squares of the groups' norms and their sums over ranks are float64 there.

The clipping itself is torch's ``clip_grads_with_norm_`` (grad x min(1, max_norm / (norm +
1e-6))), per mesh, with the norm replicated on it as a DTensor where the gradients are DTensors.
"""

from __future__ import annotations

from typing import Any

ROW = 256
"""Elements per row of a CPU gradient whose norm torch takes in fp32 (to ~2e-7 relative at worst,
a constant tensor; ~1e-8 for a trained model's)."""


def clip_global_(params: list[Any], max_norm: float, groups: tuple[Any, ...] = ()) -> Any:
    """The global L2 norm of the gradients before clipping (an fp32 scalar, the same on every
    rank), over plain gradients and DTensor gradients on any meshes, the squares summed over
    ``groups`` whose ranks hold disjoint parameters (pipeline stages); the gradients are clipped
    to ``max_norm`` when it is > 0 (0: measured only)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    by_layout: dict[Any, list[Any]] = {}
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        by_layout.setdefault(key, []).append(p)
    if not by_layout and not groups:
        return torch.zeros(())
    with torch.no_grad():
        # (layouts in the parameters' order: every rank reduces in the same order)
        parts = [_square_sum(layout, [p.grad for p in group]) for layout, group in by_layout.items()]
        sq = parts[0] if parts else torch.zeros((), dtype=torch.float64)
        for part in parts[1:]:
            sq = sq + part.to(sq.device)
        for g in groups:
            dist.all_reduce(sq, group=g)
        norm = sq.sqrt().float()
        if max_norm > 0:
            for layout, group in by_layout.items():
                local = group[0].grad.to_local().device if layout else group[0].grad.device
                total = norm.to(local) if layout is None else DTensor.from_local(norm.to(local), layout[0])
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return norm


def _square_sum(layout: tuple[Any, Any] | None, grads: list[Any]) -> Any:
    """The float64 sum of the squares of ``grads`` (all of one layout: plain, or DTensors of one
    mesh and placements): each rank's own elements, summed over the mesh dimensions that shard
    them (replicated dimensions hold the same elements)."""
    import torch
    import torch.distributed as dist

    if layout is None:
        return _local_square_sum(grads)
    mesh, placements = layout
    if any(p.is_partial() for p in placements):  # unreduced sums: only DTensor can take their norm
        n = torch.nn.utils.get_total_norm(grads, 2.0).full_tensor()
        return n.double().square()
    sq = _local_square_sum([g.to_local() for g in grads])
    for dim, p in enumerate(placements):
        if not p.is_replicate():  # Shard, and FSDP2-over-TP's strided shard
            dist.all_reduce(sq, group=mesh.get_group(dim))
    return sq


def _local_square_sum(tensors: list[Any]) -> Any:
    """The float64 sum of the squares of plain tensors on one device: on CPU each row of ``ROW``
    elements' fp32 norm, squared and summed in float64 (a view: no copy), elsewhere torch's fp32
    foreach norm squared."""
    import torch

    if tensors[0].device.type != "cpu":
        return torch.nn.utils.get_total_norm(tensors, 2.0).double().square()
    rows, tails = [], []
    for t in tensors:
        flat = t.reshape(-1)
        whole = flat.numel() - flat.numel() % ROW
        if whole:
            rows.append(torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1,
                                                 dtype=torch.promote_types(t.dtype, torch.float32)))
        if whole < flat.numel():
            tails.append(flat[whole:])
    return sum((torch.cat(x).double().square().sum() for x in (rows, tails) if x),
               torch.zeros((), dtype=torch.float64))


__all__ = ["ROW", "clip_global_"]
