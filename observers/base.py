"""The observer contract: plain classes with explicit hooks, fed by every backend.

A backend calls the hub (``Observers``) at five moments of the loop — train start, step start,
just before the optimizer step, step end (with the global-batch loss), train end — and hands it
an ``Engine``: what observers may look at of the running engine. Each observer owns the report
keys it returns from ``report()``; the hub merges them (a key owned twice is an error, so the
order observers are registered in does not matter) and rank 0 writes ``report.json``
atomically. Hooks run on every rank; an observer may use collectives in ``on_train_end``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from observers.files import atomic_write_text


class Engine(Protocol):
    """What a backend shows observers of the running engine."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def model(self) -> Any:
        """The model as the engine wrapped it (DDP, FSDP, a DeepSpeed engine, ...)."""

    @property
    def optimizers(self) -> list[Any]:
        """The optimizers as the engine steps them (DeepSpeed: its ZeRO optimizer)."""


class Observer:
    """Override the hooks you need. ``step`` counts optimizer steps: at ``on_step_start`` the
    index of the step beginning (0-based), at ``on_step_end`` the number completed."""

    def on_train_start(self, engine: Engine, step: int) -> None:
        """``step``: optimizer steps already done (a resumed run starts past 0)."""

    def on_step_start(self, engine: Engine, step: int) -> None: ...

    def on_before_optimizer_step(self, engine: Engine, step: int) -> None:
        """Gradients exist (reduced or sharded as the engine keeps them); the update has not run."""

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        """``loss``: the global-batch loss (mean over every micro-batch on every rank)."""

    def on_train_end(self, engine: Engine) -> None: ...

    def report(self) -> dict[str, Any]:
        """This observer's report keys (asked on every rank after every ``on_train_end``)."""
        return {}


class Observers:
    """The hub a backend drives: fans each hook out and writes the report at train end."""

    def __init__(self, observers: list[Observer], *, meta: dict[str, Any] | None = None,
                 report_path: Path | None = None):
        self.observers = list(observers)
        self.meta = dict(meta or {})
        self.report_path = report_path

    def train_start(self, engine: Engine, step: int) -> None:
        for o in self.observers:
            o.on_train_start(engine, step)

    def step_start(self, engine: Engine, step: int) -> None:
        for o in self.observers:
            o.on_step_start(engine, step)

    def before_optimizer_step(self, engine: Engine, step: int) -> None:
        for o in self.observers:
            o.on_before_optimizer_step(engine, step)

    def step_end(self, engine: Engine, step: int, loss: float) -> None:
        for o in self.observers:
            o.on_step_end(engine, step, loss)

    def train_end(self, engine: Engine) -> dict[str, Any]:
        """Finish every observer, merge their keys after ``meta``; rank 0 writes the report."""
        for o in self.observers:
            o.on_train_end(engine)
        report = dict(self.meta)
        owner: dict[str, str] = {}
        for o in self.observers:
            for key, value in o.report().items():
                if key in owner or key in self.meta:
                    raise ValueError(f"report key {key!r} is written by both "
                                     f"{owner.get(key, 'the run meta')} and {type(o).__name__}")
                owner[key] = type(o).__name__
                report[key] = value
        if self.report_path is not None and engine.rank == 0:
            atomic_write_text(self.report_path, json.dumps(report, indent=2) + "\n")
        return report
