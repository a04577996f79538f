"""Throughput: how long each optimizer step took, and tokens and samples per second.

Report key ``throughput``: ``step_seconds`` (median over the run's steps, the first excluded
when there are others: it carries warm-up), ``tokens_per_second`` and ``samples_per_second`` at
that median, and ``steps_timed``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from observers.base import Engine, Observer


class Throughput(Observer):
    def __init__(self, tokens_per_step: int, samples_per_step: int):
        self.tokens_per_step, self.samples_per_step = tokens_per_step, samples_per_step
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_step_start(self, engine: Engine, step: int) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        self.seconds.append(time.perf_counter() - self._t0)

    def step_seconds(self) -> float:
        timed = self.seconds[1:] or self.seconds
        return statistics.median(timed) if timed else 0.0

    def report(self) -> dict[str, Any]:
        step = self.step_seconds()

        def rate(n: int) -> float:
            return n / step if step > 0 else 0.0

        return {"throughput": {"step_seconds": step, "tokens_per_second": rate(self.tokens_per_step),
                               "samples_per_second": rate(self.samples_per_step),
                               "steps_timed": len(self.seconds[1:] or self.seconds)}}
