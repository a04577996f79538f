"""A progress bar on rank 0, counted in optimizer steps (not micro-batches), with the loss and
tokens/s of the last step. The same bar on every backend."""

from __future__ import annotations

import time

from observers.base import Engine, Observer


class ProgressBar(Observer):
    def __init__(self, max_steps: int, tokens_per_step: int):
        self.max_steps, self.tokens_per_step = max_steps, tokens_per_step
        self._progress = self._task = None
        self._last = 0.0

    def on_train_start(self, engine: Engine, step: int) -> None:
        if engine.rank != 0:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[status]}"), TimeElapsedColumn())
        self._task = self._progress.add_task("train", total=self.max_steps, completed=step, status="")
        self._progress.start()
        self._last = time.perf_counter()

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        if self._progress is None:
            return
        now = time.perf_counter()
        rate = self.tokens_per_step / max(now - self._last, 1e-9)
        self._last = now
        self._progress.update(self._task, completed=step,
                              status=f"loss {loss:.4f}  {rate:,.0f} tok/s")

    def on_train_end(self, engine: Engine) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
