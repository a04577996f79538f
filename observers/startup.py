"""Start-up by phase: where the time from the process's start to the end of the first optimizer
step goes (report key ``startup``).

One timeline per process: each ``mark(phase)`` says that the time since the previous mark (the
first: the process's start, read from ``/proc``) belonged to ``phase``, so the phases add up to
the time to the first step by construction, and a phase may own several stretches (``import``:
the entry point's modules, then the engine's inside the rank). The marks, in the order a run
meets them:

- ``import``: the interpreter and train.py's imports (``recipes.cli.run``'s ``ready``); the
  engine's import wherever it happens (``backends.get``: a ``span``)
- ``config``: Hydra's composition, strategy=auto's choice and validation (``train.py``)
- ``plan``: the planner's check (``train.py``)
- ``checkpoint_load``: which checkpoint to resume, checked whole (up to ``launchers.run``);
  loading it into the model and optimizer (each backend)
- ``rendezvous``: starting this node's ranks (our launcher; ``backends.run``) and joining the
  process group (each backend: Lightning's ``setup_environment``, Accelerate's state)
- ``op_build``: building a C++ extension at its first use, or waiting for another process's
  build of it (DeepSpeed's ops), wherever it happens: ``record``ed by the watcher that sees it
  (``backends/common/extensions.py``)
- ``data``: the data's preparation -- reading the inputs, tokenizing them or waiting for the
  rank that does, reading the token cache, counting the targets -- wherever the backend builds
  it (Lightning: before the model; Accelerate: after it), a ``span`` around the data's build
- ``model_build``: the engine's objects, the model, its wrapping and the optimizer
- ``compile``: torch.compile's warm-up inside the first step (dynamo tracing, inductor's
  kernels, the backward's lazy compile), ``record``ed from torch's compile start/end callbacks
  when the run compiles (``trainer.compile``); 0 otherwise
- ``first_step``: the data loader's start and the first optimizer step (the ``StartupTimes``
  observer), less its ``compile`` time (the data's preparation is ``data``)

A rank started by our launcher continues its parent's timeline (inherited when forked, handed
over in the environment, ``ENV``, when spawned); a rank of torchrun or ``accelerate launch``
starts at its agent's start (the command's: the agent's own start-up and rendezvous until the
rank's process starts count as ``rendezvous``), a task of srun at its own process's start. In a sweep run in one process, each job after the
first starts at the end of the job before (``restart``). Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from observers.base import Engine, Observer, Selection, observer

log = logging.getLogger(__name__)

PHASES = ("import", "config", "plan", "rendezvous", "op_build", "data", "model_build", "checkpoint_load",
          "compile", "first_step")
T = TypeVar("T")
ENV = "STRATAGEM_STARTUP"
"""A spawned rank's inherited timeline: JSON ``{"pid", "start", "marks"}`` of its launcher."""


def _now() -> float:
    """The clock of the timeline: CLOCK_BOOTTIME, the clock of /proc's process start times (one
    clock for every process of the machine)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def now() -> float:
    """The timeline's clock now (for ``record``)."""
    return _now()


def _process_start(pid: int | str = "self") -> float | None:
    """When a process started, on ``_now``'s clock (Linux: ``/proc/<pid>/stat``, field 22, in clock
    ticks since boot); None where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _initial() -> tuple[float, list[tuple[str, float]]]:
    """The timeline's start: this process's; for a first-attempt rank of torchrun (or ``accelerate
    launch``, which runs torchrun in its own process), its agent's -- the command the user ran --
    with the agent's start-up and rendezvous until this process started as ``rendezvous``."""
    own = _process_start() or _now()
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID") and env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" \
            and ENV not in env:
        agent = _process_start(os.getppid())
        if agent is not None and agent <= own:
            return agent, [("rendezvous", own)]
    return own, []


_start, _marks = _initial()
_spans: list[tuple[str, float, float]] = []


def started_at() -> float:
    """When this timeline began (the run's start: our launcher's or torchrun's agent's for their
    ranks), in seconds since the epoch."""
    return time.time() - _now() + _start


def mark(phase: str) -> None:
    """The time since the previous mark belonged to ``phase``."""
    if phase not in PHASES:
        raise ValueError(f"unknown start-up phase {phase!r} (one of {PHASES})")
    _marks.append((phase, _now()))


def marked(phase: str) -> bool:
    return any(p == phase for p, _ in _marks)


def timed(phase: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, then ``mark(phase)``. A process that marked no import before (a
    submitit task: unpickled, its config composed by the submitting process) marks it first."""
    if not marked("import"):
        mark("import")
    result = fn(*args, **kwargs)
    mark(phase)
    return result


@contextlib.contextmanager
def span(phase: str) -> Iterator[None]:
    """The block's time belongs to ``phase``, whatever the marks around it say (the engine's
    import, wherever it happens)."""
    t0 = _now()
    try:
        yield
    finally:
        _spans.append((phase, t0, _now()))


def record(phase: str, start: float, end: float) -> None:
    """The stretch from ``start`` to ``end`` (``now()``'s clock) belonged to ``phase``: a ``span``
    that another thread saw (a build the extension watcher saw from its thread)."""
    if phase not in PHASES:
        raise ValueError(f"unknown start-up phase {phase!r} (one of {PHASES})")
    if end > start:
        _spans.append((phase, start, end))


def restart() -> None:
    """A new job in this process (the next job of a sweep): its timeline starts now, with its
    modules imported already."""
    global _start, _marks, _spans
    _start = _now()
    _marks, _spans = [("import", _start)], []


def hand_over() -> None:
    """Put this process's timeline in the environment the ranks it starts inherit (``adopt``)."""
    os.environ[ENV] = json.dumps({"pid": os.getpid(), "start": _start, "marks": _marks, "spans": _spans})


def take_back() -> None:
    os.environ.pop(ENV, None)


def adopt() -> None:
    """In a rank our launcher started: continue the launcher's timeline (a forked rank has it
    already; a spawned one reads it from the environment)."""
    global _start, _marks, _spans
    raw = os.environ.get(ENV)
    if not raw:
        return
    try:
        handed = json.loads(raw)
    except ValueError:
        return
    if handed.get("pid") == os.getpid():
        return
    _start, _marks = float(handed["start"]), [(str(p), float(t)) for p, t in handed["marks"]]
    _spans = [(str(p), float(a), float(b)) for p, a, b in handed.get("spans", [])]


def report() -> dict[str, Any]:
    """``{"seconds": {phase: s}, "total": s, "first_step_at": epoch s}`` up to the first step's
    end (before it: up to now, ``first_step_at`` None)."""
    seconds = dict.fromkeys(PHASES, 0.0)
    prev, end = _start, None
    for phase, t in _marks:
        inside = 0.0  # the spans' time within this stretch is theirs
        for name, a, b in _spans:
            overlap = max(min(b, t) - max(a, prev), 0.0)
            seconds[name] += overlap
            inside += overlap
        seconds[phase] += max(t - prev - inside, 0.0)
        prev = t
        if phase == "first_step":
            end = t
            break
    epoch = time.time() - _now()  # this clock's zero, in seconds since the epoch
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()}, "total": round(prev - _start, 4),
            "started_at": round(epoch + _start, 3),
            "first_step_at": None if end is None else round(epoch + end, 3)}


def line(startup: dict[str, Any], top: int = 3) -> str:
    """``start-up 12.3 s (model_build 5.1 s, import 4.0 s, rendezvous 2.2 s)``: the largest phases."""
    biggest = sorted(startup["seconds"].items(), key=lambda kv: -kv[1])[:top]
    return (f"start-up {startup['total']:.1f} s ("
            + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in biggest if v > 0) + ")")


class StartupTimes(Observer):
    """Marks the end of the first optimizer step of this attempt and reports the timeline; while
    the first step runs a compiled model, torch's compile callbacks ``record`` its ``compile``
    spans. Also reports what the run's hot paths run (``observers/kernels.py``: ``optimizer``,
    ``attention``), read at train end: every run has these keys, as every run has a start-up."""

    def __init__(self, job: Any = None) -> None:
        self._done = False
        self.job = job
        self._hooks: tuple[Callable[..., None], Callable[..., None]] | None = None
        self._facts: dict[str, Any] = {}

    def on_train_start(self, engine: Engine, step: int) -> None:
        if self.job is not None and self.job.run.compile and self._hooks is None:
            self._hooks = _compile_callbacks()

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        if not self._done:
            self._done = True
            mark("first_step")
            if self._hooks is not None:
                _compile_callbacks(remove=self._hooks)
                self._hooks = None

    def on_train_end(self, engine: Engine) -> None:
        if self.job is None:
            return
        from observers.kernels import attention_facts, optimizer_facts

        self._facts = {"optimizer": optimizer_facts(list(engine.optimizers), self.job.trainer.optimizer),
                       "attention": attention_facts(engine.model, self.job)}

    def report(self) -> dict[str, Any]:
        return {"startup": report(), **self._facts}


def _compile_callbacks(remove: tuple[Callable[..., None], Callable[..., None]] | None = None
                       ) -> tuple[Callable[..., None], Callable[..., None]] | None:
    """Register (or ``remove``) torch dynamo's compile start/end callbacks that ``record`` each
    outermost compilation (torch runs them once around nested ones) as ``compile``; None where
    this torch has no callback handler."""
    handler = compile_callback_handler()
    if handler is None:
        return None
    if remove is not None:
        handler.remove_start_callback(remove[0])
        handler.remove_end_callback(remove[1])
        return None
    began: list[float] = []

    def start(*_: Any) -> None:
        began.append(_now())

    def end(*_: Any) -> None:
        if began:
            record("compile", began.pop(), _now())

    handler.register_start_callback(start)
    handler.register_end_callback(end)
    return start, end


COMPILE_CALLBACKS = ("register_start_callback", "register_end_callback", "remove_start_callback",
                     "remove_end_callback")


def compile_callback_handler(module: Any = None) -> Any:
    """torch dynamo's private ``callback_handler`` (of ``module``, ``torch._dynamo.callback`` by
    default), or None, said once, where this torch has none with the methods we call: the
    ``compile`` phase of the start-up is then left unmeasured (inside ``first_step``)."""
    from core.internals import lacking, lacks_message, warn_once

    if module is None:
        try:
            import torch._dynamo.callback as module
        except ImportError:
            module = None
    handler = getattr(module, "callback_handler", None)
    missing = lacking(handler, COMPILE_CALLBACKS)
    if missing:
        warn_once(log, "compile-callbacks", lacks_message(
            "the start-up timeline's compile phase", "torch._dynamo.callback.callback_handler", missing,
            "it is left unmeasured (counted in first_step); training is unaffected"))
        return None
    return handler


@observer("startup", order=10)
def _selected(s: Selection) -> Observer:
    """Always: each process's start-up timeline, and the kernels its hot paths run."""
    return StartupTimes(s.job)
