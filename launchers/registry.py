"""Which launchers there are: a registry, not a list. ``cluster.launcher=<name>`` is the module of
``launchers/`` whose top-level function carries ``@launcher("<name>", ...)`` (its
``conf/cluster/<name>.yaml`` says ``launcher: <name>``); nothing else names it.

The decorated function is the launcher's ``problems(job)``: what it cannot start from here (the
sentences ``launchers.check`` returns, after the checks of who started this process). What else
the launcher provides, it hands to the decorator:

- ``run(job, out, plan)``: it starts the job's ranks itself (ray: Ray Train workers). Without
  one, the ranks of this machine start through ``launchers.local.run_local_ranks`` when there are
  several (local, torchrun, a SageMaker container); a process some launcher started is one rank.
- a submission step for ``launch.py`` (sagemaker, k8s): ``submission_problems(job, overrides)``
  (checked on the submitting machine), ``client_problems(job)`` (what submitting from here needs: an
  SDK, a cluster, what the cluster holds; not asked by ``--dry-run``), ``dry_run(job, overrides)`` (what
  ``--dry-run`` prints: the document a tool reads -- a manifest, the job's arguments --, alone on stdout
  so it parses as printed, and the lines said of it, on stderr), ``submit(job, overrides)`` (submits;
  the line printed), ``elsewhere(path)``
  (paths that exist where the job runs, not here). A launcher without ``submit`` needs no launch
  step.
- ``checked_first``: its problems come before the checks of who started this process, which
  it then skips (torchrun: its rendezvous, whoever started this process).

``names()`` reads the registrations from the modules' source without importing them (the
config's choices); ``get(name)`` imports the one module that registers ``name``. Importing a
launcher module stays cheap: what it needs of torch, Ray or an SDK it imports when it runs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.discover import registered

if TYPE_CHECKING:
    from recipes.job import Job

Problems = Callable[["Job"], list[str]]


@dataclass(frozen=True)
class Launcher:
    name: str
    problems: Problems
    run: Callable[..., Any] | None = None
    submission_problems: Callable[[Job, list[str]], list[str]] | None = None
    client_problems: Callable[[Job], list[str]] | None = None
    dry_run: Callable[[Job, list[str]], tuple[str, list[str]]] | None = None
    submit: Callable[[Job, list[str]], str] | None = None
    elsewhere: Callable[[str], bool] | None = None
    checked_first: bool = False
    start: str = "python train.py"
    """How a user starts a job of it from their machine, before the overrides (plan.py's run-it line)."""

    @property
    def submits(self) -> bool:
        """``launch.py`` has a submission step for it (else: ``python train.py``)."""
        return self.submit is not None

    @property
    def command(self) -> str:
        """The command plan.py prints before a job's overrides: launch.py for a launcher that
        submits, else ``start``."""
        return "python launch.py" if self.submits else self.start


LAUNCHERS: dict[str, Launcher] = {}
"""name -> Launcher, for the modules imported so far (``get`` and ``every`` import them)."""


def launcher(name: str, **parts: Any) -> Callable[[Problems], Problems]:
    """Decorator for a module's ``problems(job)`` (see the module's docstring for ``parts``).
    It must sit on a top-level function with the name as a literal: ``names`` reads it there."""

    def register(problems: Problems) -> Problems:
        if name in LAUNCHERS and LAUNCHERS[name].problems.__module__ != problems.__module__:
            raise ValueError(f"launcher {name!r} is registered by both "
                             f"{LAUNCHERS[name].problems.__module__} and {problems.__module__}")
        chosen = Launcher(name, problems, **parts)
        if chosen.submit is not None and None in (chosen.submission_problems, chosen.client_problems,
                                                   chosen.dry_run):
            raise ValueError(f"launcher {name!r}: a submit step needs submission_problems, "
                             "client_problems and dry_run too")
        LAUNCHERS[name] = chosen
        return problems

    return register


@functools.cache
def _modules() -> dict[str, str]:
    """launcher name -> the module of launchers/ that registers it (from the source, no import)."""
    return registered(Path(__file__).parent, "launcher")


def names() -> tuple[str, ...]:
    """Every launcher's name (module order), without importing a launcher."""
    return tuple(_modules())


def get(name: str) -> Launcher:
    """The launcher ``cluster.launcher=name`` chose (its module imported now)."""
    if name not in LAUNCHERS:
        module = _modules().get(name)
        if module is None:
            raise KeyError(f"no launcher {name!r}; launchers/ registers: {', '.join(names())}")
        importlib.import_module(f"{__package__}.{module}")
    return LAUNCHERS[name]


def every() -> list[Launcher]:
    """All launchers (their modules imported), in ``names()`` order."""
    return [get(name) for name in names()]
