"""The communication profile's steps (observers/comm.py): one step's records summed by group and
kind, which recorded steps its averages cover, and those averages.

Which steps: every one but the first (when there are others: engines set up in it -- DeepSpeed
ZeRO-3 traces its gather order, DDP rebuilds its buckets), from the preset's warm-up's end on
(``StrategyConfig.traffic_warmup``); under a preset whose steady traffic repeats every H steps
(``StrategyConfig.traffic_period``: local SGD's parameter average, DiLoCo's outer step, every
``strategy.sync_every`` steps) the last whole periods of those steps, ending at the last one: any
H consecutive steps after the warm-up hold exactly one synchronization (local SGD's first is on
the warm-up's first step after it, DiLoCo's on its H-th), which the planner spreads over H steps.
What they are (``covered``'s second value): ``STEADY``; ``WARM_UP`` (no step left the warm-up:
the averages are the warm-up's); ``PARTIAL`` (steps past the warm-up, fewer than one period:
averaged as they are, which is not the steady state).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

STEADY, WARM_UP, PARTIAL = "steady state", "warm-up", "part of a sync period"

Step = dict[str, dict[str, dict[str, float]]]
"""group -> kind -> {count, bytes, wire_bytes, seconds, timed}: one step's records summed."""


def summarize(records: list[dict[str, Any]]) -> Step:
    """One step's records by group and kind (``seconds``: the timed ones', ``timed`` how many)."""
    out: dict = defaultdict(lambda: defaultdict(lambda: {"count": 0, "bytes": 0, "wire_bytes": 0.0,
                                                         "seconds": 0.0, "timed": 0}))
    for r in records:
        d = out[r["group"]][r["kind"]]
        d["count"] += 1
        d["bytes"] += r["bytes"]
        d["wire_bytes"] += r["wire_bytes"]
        if r["seconds"] is not None:
            d["seconds"] += r["seconds"]
            d["timed"] += 1
    return {g: dict(kinds) for g, kinds in out.items()}


def covered(recorded: list[tuple[int, Step]], warmup: int, period: int = 1) -> tuple[list[Step], str]:
    """The steps the averages cover, of ``recorded`` (each step's index over the whole run, and
    its summary), and what they are (``STEADY``, ``WARM_UP``, ``PARTIAL``; module docstring)."""
    later = recorded[1:] or recorded
    after = [s for i, s in later if i >= warmup]
    if not after:
        return ([s for _, s in later], WARM_UP) if later else ([], STEADY)
    whole = len(after) // max(1, period) * max(1, period)
    return (after[len(after) - whole:], STEADY) if whole else (after, PARTIAL)


def first_whole(recorded_from: int, warmup: int, period: int) -> int:
    """``trainer.max_steps`` whose run measures one whole period after the warm-up (the first
    recorded step, ``recorded_from``, aside)."""
    return max(warmup, recorded_from + 1) + period


def average(steps: list[Step]) -> dict[str, dict[str, dict[str, float | None]]]:
    """group -> kind -> {count, bytes, wire_bytes, seconds} per step over ``steps``; ``seconds``
    None where the backend timed none of that kind's collectives (gloo completes futures for
    some collectives only)."""
    n = max(len(steps), 1)
    acc: dict = defaultdict(lambda: defaultdict(lambda: {"count": 0.0, "bytes": 0.0, "wire_bytes": 0.0,
                                                         "seconds": None}))
    for step in steps:
        for g, kinds in step.items():
            for k, v in kinds.items():
                d = acc[g][k]
                for key in ("count", "bytes", "wire_bytes"):
                    d[key] += v[key] / n
                if v["timed"]:
                    d["seconds"] = (d["seconds"] or 0.0) + v["seconds"] / n
    return {g: {k: dict(v) for k, v in kinds.items()} for g, kinds in acc.items()}


def totals(by_group: dict[str, dict[str, dict[str, float | None]]]) -> dict[str, dict[str, float | None]]:
    """kind -> the sums over groups (``seconds`` None where no group's was timed)."""
    out: dict = defaultdict(lambda: {"count": 0.0, "bytes": 0.0, "wire_bytes": 0.0, "seconds": None})
    for kinds in by_group.values():
        for k, v in kinds.items():
            d = out[k]
            for key in ("count", "bytes", "wire_bytes"):
                d[key] += v[key]
            if v["seconds"] is not None:
                d["seconds"] = (d["seconds"] or 0.0) + v["seconds"]
    return {k: dict(v) for k, v in out.items()}
