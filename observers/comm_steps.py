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


class Recorded:
    """The steps a profile recorded, in memory that does not grow with the run: the first step
    (set aside when others follow), the sums of the later ones before the warm-up's end and after
    it, and the first ``period - 1`` after it (what a whole-periods window leaves out at its
    start). A list of every step's summary grew ~1 KB a step a rank (100 MB over 100k steps)."""

    def __init__(self, warmup: int, period: int = 1) -> None:
        self.warmup, self.period = warmup, max(1, period)
        self.count = 0
        self.first_index: int | None = None
        """The first recorded step's index over the whole run (a resumed run's: its checkpoint's)."""
        self._first: Step = {}
        self._warm, self._after = Sums(), Sums()
        self._head: list[Step] = []

    def add(self, index: int, step: Step) -> None:
        if self.first_index is None:
            self.first_index, self._first = index, step
        else:
            self._into(index, step, self._warm, self._after, self._head)
        self.count += 1

    def _into(self, index: int, step: Step, warm: Sums, after: Sums, head: list[Step]) -> None:
        if index < self.warmup:
            warm.add(step)
            return
        after.add(step)
        if len(head) < self.period - 1:
            head.append(step)

    def covered(self) -> tuple[Sums, str]:
        """The sums of the steps the averages cover, and what they are (``STEADY``, ``WARM_UP``,
        ``PARTIAL``; module docstring)."""
        warm, after, head = self._warm, self._after, self._head
        if self.count == 1:  # (the first step is all there is: it is what is averaged)
            warm, after, head = Sums(), Sums(), []
            self._into(self.first_index, self._first, warm, after, head)
        if not after.n:
            return (warm, WARM_UP) if warm.n else (Sums(), STEADY)
        whole = after.n // self.period * self.period
        return (after.without(head[:after.n - whole]), STEADY) if whole else (after, PARTIAL)


class Sums:
    """group -> kind -> {count, bytes, wire_bytes, seconds, timed} summed over ``n`` steps."""

    def __init__(self) -> None:
        self.n = 0
        self.by: dict = defaultdict(lambda: defaultdict(lambda: {"count": 0, "bytes": 0, "wire_bytes": 0.0,
                                                                "seconds": 0.0, "timed": 0}))

    def add(self, step: Step, sign: int = 1) -> None:
        self.n += sign
        for g, kinds in step.items():
            for k, v in kinds.items():
                d = self.by[g][k]
                for key in d:
                    d[key] += sign * v[key]

    def without(self, steps: list[Step]) -> Sums:
        """These sums less ``steps`` (a copy)."""
        out = Sums()
        out.add(self.by)
        for s in steps:
            out.add(s, -1)
        out.n = self.n - len(steps)
        return out

    def average(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """group -> kind -> {count, bytes, wire_bytes, seconds} per step; ``seconds`` None where the
        backend timed none of that kind's collectives (gloo completes futures for some only)."""
        n = max(self.n, 1)
        out = {g: {k: {"count": v["count"] / n, "bytes": v["bytes"] / n, "wire_bytes": v["wire_bytes"] / n,
                       "seconds": v["seconds"] / n if v["timed"] else None}
                   for k, v in kinds.items() if v["count"]}  # (a kind only the left-out steps had: none)
               for g, kinds in self.by.items()}
        return {g: kinds for g, kinds in out.items() if kinds}


def first_whole(recorded_from: int, warmup: int, period: int) -> int:
    """``trainer.max_steps`` whose run measures one whole period after the warm-up (the first
    recorded step, ``recorded_from``, aside)."""
    return max(warmup, recorded_from + 1) + period


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
