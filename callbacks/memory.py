"""Memory profile: what each rank really holds (params, grads, optimizer state), measured from
the live objects after the first optimizer step, and each rank's peak resident memory.

The result goes into the run report as ``memory``: ``{"ranks": [{"rank", "params", "grads",
"optimizer", "peak_rss"}, ...], "predicted": {...}}`` (bytes; ``predicted`` is the planner's
per-device numbers for the same preset when the planner is available).
"""

from __future__ import annotations

import resource
from typing import Any

import lightning as L
import torch.distributed as dist

from callbacks.report import RunReport


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MemoryProfile(L.Callback):
    def __init__(self, strategy: Any, report: RunReport, predicted: dict[str, int] | None = None):
        self.strategy, self.report, self.predicted = strategy, report, predicted
        self.held: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if "grads" not in self.held:  # gradients exist between backward and the step
            self.held["grads"] = self.strategy.held_bytes(trainer, "grads")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= 1 and "optimizer" not in self.held:
            self.held["params"] = self.strategy.held_bytes(trainer, "params")
            self.held["optimizer"] = self.strategy.held_bytes(trainer, "optimizer")

    def on_train_end(self, trainer, pl_module) -> None:
        mine = {"rank": trainer.global_rank, **self.held, "peak_rss": _peak_rss()}
        ranks = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        self.report.sections["memory"] = {"ranks": ranks, "predicted": self.predicted}
