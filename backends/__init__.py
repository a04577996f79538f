"""Backends turn a validated ``Job`` into an engine run. One module (or subpackage) per engine,
``backends/<name>``, selected by ``conf/backend/<name>.yaml``; a new backend is those two files
and nothing else changes. The engine is imported only when its backend is chosen.

Every backend module provides the ``Backend`` protocol below as module-level functions.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from strategies import ConfigError
from strategies.conf import CONF_DIR

if TYPE_CHECKING:
    from observers import Observers
    from recipes.job import Job



@dataclass
class Outcome:
    """What a finished run tells train.py (the report itself is written by the observers)."""

    rank: int
    report: dict[str, Any] = field(default_factory=dict)
    """The merged report, as written by rank 0 (every rank gets its own copy)."""


class Backend(Protocol):
    def problems(self, job: Job) -> list[str]:
        """What this engine cannot run of the job (a preset it does not support), before launch."""

    def build(self, job: Job, out: Path, observers: Observers) -> Any:
        """The engine objects for the job, observers attached; starts no process."""

    def fit(self, built: Any) -> Outcome:
        """Train (starting the ranks if the engine does), export what the job asks for."""


def names() -> list[str]:
    """The backends: the stems of ``conf/backend/*.yaml``."""
    from recipes.config import BACKENDS

    return list(BACKENDS)


def _unknown(name: str) -> str:
    return (f"backend.name={name!r} is not a backend; available: {', '.join(names())} "
            f"(each is a file in {CONF_DIR / 'backend'}): set backend=<one of them>")


def get(name: str) -> Backend:
    """The backend module named ``name`` (imported now; its engine with it)."""
    if name not in names():
        raise ConfigError(_unknown(name))
    return importlib.import_module(f"backends.{name}")


def check(job: Job) -> list[str]:
    """The chosen backend's problems with the job (for ``recipes.job.validate(extra=...)``)."""
    if job.backend not in names():
        return [_unknown(job.backend)]
    return get(job.backend).problems(job)


def run(job: Job, out: Path, plan: dict[str, Any] | None = None) -> Outcome:
    """One rank of the job (or the whole job, when it has one process): the observers, the
    chosen backend's build and fit, and a clean exit from the process group."""
    import observers
    from backends.common import quiet
    from checkpoints.interrupt import Interrupted

    quiet.install()  # third-party console noise, filtered in one place (backends/common/quiet.py)
    backend = get(job.backend)
    ok = False
    try:
        built = backend.build(job, out, observers.build(job, out, plan))
        outcome = backend.fit(built)
        ok = True
        return outcome
    except Interrupted:
        ok = True  # every rank stopped after the same step: the barrier meets
        raise
    finally:
        teardown(ok)


def teardown(ok: bool) -> None:
    """Leave no process group behind: gloo aborts at exit without barrier + destroy."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()
