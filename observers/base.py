"""The observer contract: plain classes with explicit hooks, fed by every backend.

A backend calls the hub (``Observers``) at these moments of the loop and hands it an ``Engine``
(what observers may look at of the running engine):

    resume(step, path, history)           (a resumed run, before train_start: the record so far)
    train_start
      step_start
        forward_start, forward_end        (each micro-batch: around the forward pass)
        before_optimizer_step             (gradients ready, update not run)
      step_work_end                       (the update has run; the loss is not reduced yet)
      step_end(loss)                      (the global-batch loss)
      validation_start, validation_end(metrics)  (after the steps trainer.val_every names, and the last)
    train_end
    publish                               (after the process group is gone: report.json, on_report)
 Each observer owns the report
keys it returns from ``report()``; the hub merges them (a key owned twice is an error, so the
order observers are registered in does not matter) at ``train_end``, and at ``publish`` rank 0
writes ``report.json`` atomically and every observer's ``on_report`` runs. Hooks run on every
rank; an observer may use collectives in ``on_train_end``, never in ``on_report``: the runner
(``backends.run``) publishes after its last collective, so one rank's writes (the report, plots,
a logger's upload) are not waited for by peers bounded by ``cluster.collective_timeout``.

A run that resumes continues one record: each checkpoint carries ``Observers.history()`` (what
every observer's ``history`` returns: losses, validations), and a resumed run hands it back
through ``on_resume``, so report.json covers the whole run from step 1 with ``resumed_from``.

Which observers a run has is a registry, not a list: each module of ``observers/`` registers a
factory with ``@observer(name, order)`` (``Selection`` -> its observer, or None when the job does
not select it), and ``observers.build`` runs them all in order.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from observers.files import atomic_write_text

if TYPE_CHECKING:
    from recipes.job import Job


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

    def grad_norm(self) -> float | None:
        """After a step: the global L2 norm of its gradients before clipping (across shards,
        meshes and pipeline stages; every rank has it); None where the engine does not say."""

    def logits(self, tokens: Any) -> Any:
        """The logits of ``tokens`` (a (batch, seq) CPU tensor) through the model as the engine
        wraps it, under the run's precision; every rank calls it together (callbacks.samples)."""


def learning_rate(engine: Engine) -> float:
    """The learning rate the coming optimizer step uses (ask before it: the scheduler moves it
    after). Every group shares the schedule: the first group's."""
    return float(engine.optimizers[0].param_groups[0]["lr"])


@dataclass(frozen=True)
class Ended:
    """The engine as ``on_report`` sees it: the rank it was. The engine itself is torn down by
    then (Accelerate's state reset, the process group destroyed: ``backends.run``)."""
    rank: int


class Observer:
    """Override the hooks you need. ``step`` counts optimizer steps: at ``on_step_start`` the
    index of the step beginning (0-based), at ``on_step_end`` the number completed."""

    def on_resume(self, engine: Engine, step: int, history: dict[str, Any]) -> None:
        """A resumed run, before ``on_train_start``: ``history`` is what ``history`` returned
        when the checkpoint of ``step`` was saved (empty for a checkpoint without one)."""

    def history(self) -> dict[str, Any]:
        """What this observer's record needs to continue after a resume (JSON; saved with
        every checkpoint, on rank 0). Keys are owned as report keys are. Every rank asks it
        together, before each save: a collective may gather what differs by rank (observers/moe.py)."""
        return {}

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

    def on_validation_start(self, engine: Engine, step: int) -> None:
        """A validation after ``step`` optimizer steps begins (``on_validation_end`` follows)."""

    def on_validation_end(self, engine: Engine, step: int, metrics: dict[str, Any]) -> None:
        """A validation after ``step`` optimizer steps: ``metrics`` has ``loss`` (mean token
        cross entropy over the held-out samples, every rank's) and ``perplexity``."""

    def on_train_end(self, engine: Engine) -> None: ...

    def report(self) -> dict[str, Any]:
        """This observer's report keys (asked on every rank after every ``on_train_end``)."""
        return {}

    def on_report(self, engine: Ended, report: dict[str, Any]) -> None:
        """The merged report, once written (loggers and plots draw from it); the process group
        and the engine are gone by then: no collective here, only the rank (``Ended``)."""


class Observers:
    """The hub a backend drives: fans each hook out and writes the report at train end."""

    def __init__(self, observers: list[Observer], *, meta: dict[str, Any] | None = None,
                 report_path: Path | None = None):
        self.observers = list(observers)
        self.meta = dict(meta or {})
        self.report_path = report_path
        self._ended: tuple[Engine, dict[str, Any]] | None = None

    def _each(self, hook: str, *args: Any) -> None:
        for o in self.observers:
            getattr(o, hook)(*args)

    def resume(self, engine: Engine, step: int, path: Path, history: dict[str, Any]) -> None:
        """The run continues the checkpoint at ``path`` (step ``step``) and its record."""
        self.meta["resumed_from"] = {"step": step, "path": str(path)}
        self._each("on_resume", engine, step, history)

    def history(self) -> dict[str, Any]:
        """Every observer's record so far, for the checkpoint being saved."""
        return self._merged("history")

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

    def validation_start(self, engine: Engine, step: int) -> None:
        self._each("on_validation_start", engine, step)

    def validation_end(self, engine: Engine, step: int, metrics: dict[str, Any]) -> None:
        self._each("on_validation_end", engine, step, metrics)

    def train_end(self, engine: Engine) -> dict[str, Any]:
        """Finish every observer (collectives allowed), merge their keys after ``meta``: the
        report, which ``publish`` writes."""
        self._each("on_train_end", engine)
        report = {"resumed_from": None, **self.meta, **self._merged("report", taken=set(self.meta))}
        self._ended = (Ended(engine.rank), report)
        return report

    def publish(self) -> None:
        """Rank 0 writes the report ``train_end`` merged; every observer's ``on_report`` (plots,
        loggers). Local work only: called once no peer waits in a collective (``backends.run``,
        after teardown). Nothing when ``train_end`` did not run (a stopped run)."""
        if self._ended is None:
            return
        (engine, report), self._ended = self._ended, None
        if self.report_path is not None and engine.rank == 0:
            atomic_write_text(self.report_path, json.dumps(report, indent=2) + "\n")
        self._each("on_report", engine, report)

    def _merged(self, method: str, taken: set[str] = frozenset()) -> dict[str, Any]:
        """Every observer's ``method()`` in one dict; a key owned twice is an error."""
        merged: dict[str, Any] = {}
        owner = dict.fromkeys(taken, "the run meta")
        for o in self.observers:
            for key, value in getattr(o, method)().items():
                if key in owner:
                    raise ValueError(f"{method} key {key!r} is written by both {owner[key]} and "
                                     f"{type(o).__name__}")
                owner[key] = type(o).__name__
                merged[key] = value
        return merged


# ------------------------------------------------------------------------------ the registry
@dataclass
class Selection:
    """What an observer's factory decides from: the validated job (its ``callbacks`` and
    ``logger`` groups select), the run directory, the planner's prediction for this run (None:
    not planned), and the observers chosen before it, by registered name (``Comparison`` reads
    the memory, communication and throughput observers)."""

    job: Job
    out: Path
    plan: dict[str, Any] | None
    chosen: dict[str, Observer] = field(default_factory=dict)


Factory = Callable[[Selection], "Observer | None"]
OBSERVERS: dict[str, tuple[int, Factory]] = {}
"""name -> (order, factory); ``observers.build`` runs the factories of every module in
``observers/`` by order."""
KNOBS: dict[str, type] = {}
"""name -> the dataclass of the keys that observer reads under ``callbacks.`` (its config, declared
in its module); ``observers.callbacks_schema`` makes the ``callbacks`` group's schema of them."""


def observer(name: str, order: int, knobs: type | None = None) -> Callable[[Factory], Factory]:
    """Decorator for a module's factory: ``selection -> Observer`` when the job selects it, else
    None. ``order``: where it stands in the report's ``observers`` list (and is fed: hooks run in
    this order). ``knobs``: a dataclass (core/stdlib types, ``core.knobs`` declarations) whose
    fields are this observer's ``callbacks.<key>`` keys, each with its default and docstring; the
    factory reads them from ``selection.job.callbacks``."""

    def register(factory: Factory) -> Factory:
        if name in OBSERVERS and OBSERVERS[name][1].__module__ != factory.__module__:
            raise ValueError(f"observer {name!r} is registered by both {OBSERVERS[name][1].__module__} "
                             f"and {factory.__module__}")
        OBSERVERS[name] = (order, factory)
        if knobs is not None:
            KNOBS[name] = knobs
        return factory

    return register
