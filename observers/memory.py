"""Memory profile: what each rank really holds (params, grads, optimizer state), measured from
the live objects, and each rank's peak resident memory.

Gradients are counted just before the first optimizer step (they exist between backward and
the update), parameters and optimizer state right after it. Report key ``memory``:
``{"ranks": [{"rank", "params", "grads", "optimizer", "peak_rss"}, ...], "predicted": {...}}``
(bytes; ``predicted`` is the planner's per-device numbers for the same preset, when planned).
"""

from __future__ import annotations

import resource
from typing import Any

from observers.base import Engine, Observer


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def all_gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (just ``[obj]`` without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class MemoryProfile(Observer):
    def __init__(self, strategy: Any, predicted: dict[str, int] | None = None):
        """``strategy``: the preset's config, whose ``held_bytes`` knows where its engine keeps
        each state."""
        self.strategy, self.predicted = strategy, predicted
        self.held: dict[str, int] = {}
        self.ranks: list[dict[str, Any]] = []

    def _held(self, engine: Engine, what: str) -> int:
        return self.strategy.held_bytes(engine.model, engine.optimizers, what)

    def on_before_optimizer_step(self, engine: Engine, step: int) -> None:
        if "grads" not in self.held:
            self.held["grads"] = self._held(engine, "grads")

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        if "optimizer" not in self.held:
            self.held["params"] = self._held(engine, "params")
            self.held["optimizer"] = self._held(engine, "optimizer")

    def on_train_end(self, engine: Engine) -> None:
        self.ranks = all_gather({"rank": engine.rank, **self.held, "peak_rss": peak_rss()})

    def report(self) -> dict[str, Any]:
        return {"memory": {"ranks": self.ranks, "predicted": self.predicted}}
