"""The run's record: the global-batch loss of every optimizer step, and the loop's wall time.

Report keys (documented in README): ``steps``, ``losses``, ``final_loss``, ``wall_seconds``,
``tokens_per_second``, ``validation`` (one ``{step, loss, perplexity, samples}`` per validation;
empty without a validation split). The backend computes each step's loss (the mean over all its
micro-batches on all data-parallel ranks) and hands it to ``on_step_end``.
"""

from __future__ import annotations

import time
from typing import Any

from observers.base import Engine, Observer


class LossLog(Observer):
    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.losses: list[float] = []
        self.validation: list[dict[str, Any]] = []
        self._start = self._end = 0.0

    def on_train_start(self, engine: Engine, step: int) -> None:
        self._start = time.perf_counter()

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        self.losses.append(float(loss))

    def on_validation_end(self, engine: Engine, step: int, metrics: dict[str, Any]) -> None:
        self.validation.append(dict(metrics))

    def on_train_end(self, engine: Engine) -> None:
        self._end = time.perf_counter()

    def report(self) -> dict[str, Any]:
        wall = self._end - self._start
        return {"steps": len(self.losses), "losses": self.losses,
                "final_loss": self.losses[-1] if self.losses else None, "wall_seconds": wall,
                "validation": self.validation,
                "tokens_per_second": len(self.losses) * self.tokens_per_step / wall if wall > 0 else 0.0}
