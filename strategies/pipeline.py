"""Cutting a model into pipeline stages, engine-neutral: which blocks each stage holds (balanced by
parameter count, or as ``strategy.split`` says), which stages a pipeline rank runs under each of
torch's schedules, and a stage as a view of the model that keeps the full model's parameter
names. The model declares how it is cut (``pp_plan``: its ModuleDict of blocks, and the modules
only the first or last stage runs). A backend's pipeline runner gives these stages to
``torch.distributed.pipelining`` (backends/lightning/pipeline.py).
"""

from __future__ import annotations

import functools
from typing import Any

# schedule name -> (torch class, virtual stages it needs: 1 or >= 2, stage placement)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", 2, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}


def balanced_split(costs: list[float], first: float, last: float, stages: int) -> list[int]:
    """Blocks per stage, contiguous, minimising the largest stage's parameter count; the first
    stage also carries ``first`` (embedding), the last ``last`` (norm and head)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @functools.cache
    def best(i: int, s: int) -> tuple[float, tuple[int, ...]]:
        """Blocks i.. over stages s.. : (largest stage, sizes)."""
        if s == stages - 1:
            return prefix[n] - prefix[i] + last + (first if s == 0 else 0), (n - i,)
        out = (float("inf"), ())
        for j in range(i + 1, n - (stages - 1 - s) + 1):
            here = prefix[j] - prefix[i] + (first if s == 0 else 0)
            rest, sizes = best(j, s + 1)
            cand = (max(here, rest), (j - i, *sizes))
            out = min(out, cand)
        return out

    return list(best(0, 0)[1])


def stage_ids(schedule: str, pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages a pipeline rank holds: r, r + P, ... (looped), or r and 2P-1-r (a V)."""
    if SCHEDULES[schedule][2] == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


def stage_owner(schedule: str, stage: int, pp: int, virtual: int) -> int:
    """The pipeline rank that holds ``stage``."""
    for r in range(pp):
        if stage in stage_ids(schedule, r, pp, virtual):
            return r
    raise ValueError(f"stage {stage} is held by no pipeline rank of {pp}")


def build_stage(full: Any, layer_ids: list[int], first: bool, last: bool) -> Any:
    """A view of the model that runs only ``layer_ids``: it shares the kept blocks and modules
    with ``full`` (no copy) and has the others deleted (set to None), so what stays keeps its
    names. Several views of one model share their parameters."""
    import copy

    import torch

    plan = type(full).pp_plan
    stage = copy.copy(full)  # a new module object over the same children
    stage._modules, stage._parameters, stage._buffers = (
        dict(full._modules), dict(full._parameters), dict(full._buffers))
    blocks = getattr(full, plan["blocks"])
    setattr(stage, plan["blocks"], torch.nn.ModuleDict({str(i): blocks[str(i)] for i in layer_ids}))
    for name in plan["first"] if not first else ():
        setattr(stage, name, None)
    for name in plan["last"] if not last else ():
        setattr(stage, name, None)
    return stage


def split_model(full: Any, stages: int, sizes: list[int] | None = None) -> list[list[int]]:
    """Layer indices per stage: ``sizes`` (blocks per stage) or balanced by parameter count."""
    plan = type(full).pp_plan
    blocks = getattr(full, plan["blocks"])
    if sizes is None:
        count = lambda mods: float(sum(p.numel() for m in mods if m is not None  # noqa: E731
                                       for p in m.parameters()))
        costs = [count([b]) for b in blocks.values()]
        sizes = balanced_split(costs, count([getattr(full, n) for n in plan["first"]]),
                               count([getattr(full, n) for n in plan["last"]]), stages)
    out, i = [], 0
    for s in sizes:
        out.append(list(range(i, i + s)))
        i += s
    return out


__all__ = ["SCHEDULES", "balanced_split", "build_stage", "split_model", "stage_ids", "stage_owner"]
