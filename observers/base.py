"""The observer contract: plain classes with explicit hooks, fed by every backend.

A backend calls the hub (``Observers``) at these moments of the loop and hands it an ``Engine``
(what observers may look at of the running engine):

    train_start
      step_start
        forward_start, forward_end        (each micro-batch: around the forward pass)
        before_optimizer_step             (gradients ready, update not run)
      step_work_end                       (the update has run; the loss is not reduced yet)
      step_end(loss)                      (the global-batch loss)
      validation_end(metrics)             (after the steps trainer.val_every names, and the last)
    train_end
 Each observer owns the report
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

    def held_bytes(self, what: str) -> int:
        """Bytes of params | grads | optimizer this rank holds right now (local shards), counted
        where the engine keeps them."""


class Observer:
    """Override the hooks you need. ``step`` counts optimizer steps: at ``on_step_start`` the
    index of the step beginning (0-based), at ``on_step_end`` the number completed."""

    def on_train_start(self, engine: Engine, step: int) -> None:
        """``step``: optimizer steps already done (a resumed run starts past 0)."""

    def on_step_start(self, engine: Engine, step: int) -> None: ...

    def on_forward_start(self, engine: Engine, step: int) -> None:
        """A micro-batch's forward pass begins (its backward follows ``on_forward_end``)."""

    def on_forward_end(self, engine: Engine, step: int) -> None: ...

    def on_before_optimizer_step(self, engine: Engine, step: int) -> None:
        """Gradients exist (reduced or sharded as the engine keeps them); the update has not run."""

    def on_step_work_end(self, engine: Engine, step: int) -> None:
        """The step's training work is done (the update ran); the backend has not yet reduced
        the loss for the report, so collectives from here on are not training traffic."""

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        """``loss``: the global-batch loss (mean over every micro-batch on every rank)."""

    def on_validation_end(self, engine: Engine, step: int, metrics: dict[str, Any]) -> None:
        """A validation after ``step`` optimizer steps: ``metrics`` has ``loss`` (mean token
        cross entropy over the held-out samples, every rank's) and ``perplexity``."""

    def on_train_end(self, engine: Engine) -> None: ...

    def report(self) -> dict[str, Any]:
        """This observer's report keys (asked on every rank after every ``on_train_end``)."""
        return {}

    def on_report(self, engine: Engine, report: dict[str, Any]) -> None:
        """The merged report, once written (loggers and plots draw from it)."""


class Observers:
    """The hub a backend drives: fans each hook out and writes the report at train end."""

    def __init__(self, observers: list[Observer], *, meta: dict[str, Any] | None = None,
                 report_path: Path | None = None):
        self.observers = list(observers)
        self.meta = dict(meta or {})
        self.report_path = report_path

    def _each(self, hook: str, *args: Any) -> None:
        for o in self.observers:
            getattr(o, hook)(*args)

    def train_start(self, engine: Engine, step: int) -> None:
        self._each("on_train_start", engine, step)

    def step_start(self, engine: Engine, step: int) -> None:
        self._each("on_step_start", engine, step)

    def forward_start(self, engine: Engine, step: int) -> None:
        self._each("on_forward_start", engine, step)

    def forward_end(self, engine: Engine, step: int) -> None:
        self._each("on_forward_end", engine, step)

    def before_optimizer_step(self, engine: Engine, step: int) -> None:
        self._each("on_before_optimizer_step", engine, step)

    def step_work_end(self, engine: Engine, step: int) -> None:
        self._each("on_step_work_end", engine, step)

    def step_end(self, engine: Engine, step: int, loss: float) -> None:
        self._each("on_step_end", engine, step, loss)

    def validation_end(self, engine: Engine, step: int, metrics: dict[str, Any]) -> None:
        self._each("on_validation_end", engine, step, metrics)

    def train_end(self, engine: Engine) -> dict[str, Any]:
        """Finish every observer, merge their keys after ``meta``; rank 0 writes the report."""
        self._each("on_train_end", engine)
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
        self._each("on_report", engine, report)
        return report
