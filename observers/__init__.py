"""Observers: the run's record, memory and communication profiles, throughput, the planner's
prediction beside what was measured, plots, loggers and progress (a bar, or log lines) -- plain classes that
every backend feeds through the same hooks (observers/base.py). Each module registers its own
(``@observer(name, order)`` on a factory that reads the job and returns the observer or None;
``observers/loggers.py``'s ``@logger(name)`` likewise), found here, not listed: the ``callbacks``
config group selects them; ``logger`` picks a logger."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from observers.base import KNOBS, OBSERVERS, Engine, Observer, Observers, Selection, observer
from observers.memory import MemoryProfile
from observers.progress import Progress
from observers.report import LossLog
from observers.startup import StartupTimes
from observers.throughput import Throughput

if TYPE_CHECKING:
    from recipes.job import Job

__all__ = ["Engine", "LossLog", "MemoryProfile", "Observer", "Observers", "Progress", "Selection",
           "StartupTimes", "Throughput", "build", "callbacks_schema", "observer"]


def _discover() -> None:
    """Import every module here once: each registers its observers with ``@observer``."""
    if not getattr(_discover, "done", False):
        for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
            importlib.import_module(f"{__name__}.{module}")
        _discover.done = True


def _ordered() -> list[tuple[str, tuple[int, Any]]]:
    return sorted(OBSERVERS.items(), key=lambda item: (item[1][0], item[0]))


def callbacks_schema(module: str) -> type:
    """The ``callbacks`` group's schema: one dataclass (named ``CallbacksConfig``, living in
    ``module``) whose fields are every registered observer's knobs, in the observers' order -- what
    Hydra checks a ``callbacks.*`` key against and validation reads. Only this module and the
    observers' (core/stdlib at import) load: no engine, no torch. A key two observers declare is an
    error naming both."""
    _discover()
    owner: dict[str, str] = {}
    bases = []
    for name, _ in _ordered():
        if name not in KNOBS:
            continue
        for f in dataclasses.fields(KNOBS[name]):
            if f.name in owner:
                raise ValueError(f"callbacks.{f.name} is declared by both observer {owner[f.name]!r} "
                                 f"and observer {name!r}")
            owner[f.name] = name
        bases.append(KNOBS[name])
    doc = "Observers (observers/), the same on every backend: each observer's keys, from its module."
    # (a dataclass collects its bases' fields last base first: reversed, the first observer leads)
    return dataclasses.make_dataclass("CallbacksConfig", [], bases=tuple(reversed(bases)),
                                      namespace={"__module__": module, "__doc__": doc})


def build(job: Job, out: Path, plan: dict[str, Any] | None = None) -> Observers:
    """The observers ``job.callbacks`` and ``job.logger`` select (each registered observer's
    factory decides, in their order); ``plan``: the planner's prediction for this run
    (``planner.plan_dict``), reported next to what is measured."""
    _discover()
    selection = Selection(job, out, plan)
    for name, (_, factory) in _ordered():
        chosen = factory(selection)
        if chosen is not None:
            selection.chosen[name] = chosen
    chosen = list(selection.chosen.values())
    meta = job.meta() | {"observers": [type(o).__name__ for o in chosen]}
    if plan is not None:
        meta["plan"] = {k: plan[k] for k in ("fits", "communication", "step_seconds", "chosen_by",
                                             "tight", "margin", "device_memory") if k in plan}
    return Observers(chosen, meta=meta, report_path=out / "report.json" if job.callbacks.report else None)
