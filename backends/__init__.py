"""Backends turn a validated ``Job`` into an engine run. One module (or subpackage) per engine,
``backends/<name>``, selected by ``conf/backend/<name>.yaml``; a new backend is those two files
and nothing else changes. The engine is imported only when its backend is chosen.

Every backend module provides the ``Backend`` protocol below as module-level functions.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from strategies import ConfigError
from core.collect import collect_here
from core.conf import CONF_DIR

if TYPE_CHECKING:
    from observers import Observers
    from recipes.job import Job

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What a finished run tells train.py (the report itself is written by the observers)."""

    rank: int
    report: dict[str, Any] = field(default_factory=dict)
    """The merged report, as written by rank 0 (every rank gets its own copy)."""
    params: dict[str, Any] | None = field(default=None, repr=False)
    """``trainer.export_params``: the full parameters, gathered (a collective) on every rank and
    kept by rank 0 only; ``run`` writes them to ``params.pt`` once the process group is gone and
    drops them (None in what ``run`` returns)."""


class Backend(Protocol):
    def problems(self, job: Job) -> list[str]:
        """What this engine cannot run of the job (a preset it does not support), before launch."""

    def build(self, job: Job, out: Path, observers: Observers) -> Any:
        """The engine objects for the job, observers attached; starts no process."""

    def fit(self, built: Any) -> Outcome:
        """Train (starting the ranks if the engine does); gather what the job exports
        (``Outcome.params``) but write nothing of one rank alone: ``run`` does, after teardown."""

    # optional: ``load_engine()`` imports the engine (``get`` calls it, so the import is counted as
    # import time in report.json's ``startup``, wherever it happens); ``forget(built)`` frees what
    # the engine keeps in the process after a run, ``built`` None when the build failed
    # (``leave_nothing`` calls it)


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
    from observers import startup

    with startup.span("import"):  # (report.json's startup: the engine's import is import time)
        module = importlib.import_module(f"backends.{name}")
        if hasattr(module, "load_engine"):  # the engine itself, which the backend imports lazily
            module.load_engine()
    return module


def check(job: Job) -> list[str]:
    """The chosen backend's problems with the job (for ``recipes.job.validate(extra=...)``)."""
    if job.backend not in names():
        return [_unknown(job.backend)]
    return get(job.backend).problems(job)


def run(job: Job, out: Path, plan: dict[str, Any] | None = None) -> Outcome:
    """One rank of the job (or the whole job, when it has one process): the observers, the
    chosen backend's build and fit, and a clean exit from the process group; then rank 0's own
    writes (``finish``)."""
    import observers
    from backends.common import extensions, quiet
    from checkpoints.interrupt import Interrupted
    from checkpoints.interrupt import current as interruption
    from observers import startup
    from observers.memory import allocate_exactly

    allocate_exactly(False)  # glibc's steady state for a training loop (observers/memory.py says why)
    startup.adopt()  # a rank our launcher started continues its timeline (report.json's startup)
    startup.mark("rendezvous")  # (starting the ranks)
    quiet.install()  # third-party console noise, filtered in one place (backends/common/quiet.py)
    backend = get(job.backend)
    freeze_imports()
    env = launch_env()
    built, ok = None, False
    try:
        # a C++ op built at first use (DeepSpeed's), or waited for, is said and timed (op_build)
        with extensions.watch():
            hub = observers.build(job, out, plan)
            built = backend.build(job, out, hub)
            startup.mark("model_build")  # (the engine's objects; the model itself where the engine builds it)
            outcome = backend.fit(built)
        ok = True
    except Interrupted:
        ok = True  # every rank stopped after the same step: the barrier meets
        raise
    finally:
        leave_nothing(backend, built, env, ok)
        interruption().release()  # Ctrl-C stops at a step boundary only while there are steps
    finish(outcome, hub, out)
    return outcome


def finish(outcome: Outcome, hub: Observers, out: Path) -> None:
    """What one rank does alone at the end, after ``teardown``: report.json, the plots and the
    loggers' close (``Observers.publish``), then ``params.pt`` (``trainer.export_params``). No
    peer waits for it in a collective, so a write of any length (a 70B model's params.pt is
    ~280 GB from rank 0) is not bounded by ``cluster.collective_timeout``; the other ranks have
    left, and the launcher waits for this one. A failed write fails the run, naming the file."""
    hub.publish()
    params, outcome.params = outcome.params, None
    if params is None:
        return
    from observers.files import atomic_torch_save

    path, start = out / "params.pt", time.perf_counter()
    log.info("trainer.export_params: writing %s", path)
    try:
        atomic_torch_save(params, path)
    except OSError as e:  # (a full disk's message names the file already: observers/files.py)
        detail = e.strerror or str(e)
        raise OSError(e.errno, f"trainer.export_params=true: "
                               f"{detail if str(path) in detail else f'writing {path}: {detail}'}") from e
    log.info("trainer.export_params: wrote %s (%.1f s)", path, time.perf_counter() - start)


def freeze_imports() -> None:
    """Move every object alive now -- the imported libraries' modules, classes and functions, a
    few hundred thousand once torch, Lightning and DeepSpeed are in -- out of the cyclic
    collector's reach (``gc.freeze``). They live as long as the process; each full collection
    afterwards (Python's own, the engines' ``gc.collect()`` calls, ``teardown``'s) scans only
    the run's objects: 0.7 s less per collection on a 2-core machine. Nothing of the run exists
    yet (the model, engine and process group are built after this), so nothing the run frees is
    frozen. A forked rank shares the parent's frozen pages instead of copying them on write. A
    later run in the same process (a sweep's jobs, run one after another) first collects what the
    one before left, so that is freed, not frozen."""
    import gc

    if gc.get_freeze_count():
        gc.collect()  # (scans only what is not frozen: the last run's leftovers)
    gc.freeze()


LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torch's env:// variables: a launcher's (``launchers.launched`` reads them), or set by an engine
for a process group of one (Lightning's DeepSpeed strategy, ``backends/accelerate/state.py``)."""


def launch_env() -> dict[str, str]:
    """The variables a run may set that say how this process was launched: ``LAUNCH_ENV`` and
    Accelerate's ``ACCELERATE_*`` (read by its state, set by ``Accelerator`` and ours)."""
    import os

    return {k: v for k, v in os.environ.items() if k in LAUNCH_ENV or k.startswith("ACCELERATE_")}


def leave_nothing(backend: Backend, built: Any, env: dict[str, str], ok: bool) -> None:
    """The end of a run in this process, what its engine made gone with it: the one place. A
    sweep runs its one-process jobs one after another in its own process, so what a job leaves
    is the next job's start -- Accelerate's state singletons (a job of another layout failed
    "Accelerate built ['NO'] ... but the preset needs DEEPSPEED"), a DeepSpeed engine its hooks
    keep alive (the whole model and optimizer, in the next job's RSS), DeepSpeed's groups (its
    next engine broadcast on a destroyed one), the torch env:// variables a group of one set (the
    next job took RANK=0 as a launcher's). In order: the backend's ``forget(built)`` (its engine's
    objects and process-wide state), ``teardown(ok)`` (the garbage collected, the process group
    destroyed), and ``env`` (``launch_env()`` at the run's start) restored: the variables the run
    added removed, the ones it changed set back (a rank a launcher started finds its own)."""
    import os

    forget = getattr(backend, "forget", None)
    try:
        if forget is not None:
            forget(built)
    except Exception as e:  # noqa: BLE001  (the run's own error, if any, is the news)
        log.warning("the run's engine state was not all released (%s: %s): a next run in this "
                    "process may find it", type(e).__name__, e)
    teardown(ok)
    for key in set(launch_env()) - set(env):
        del os.environ[key]
    os.environ.update(env)


def teardown(ok: bool) -> None:
    """Leave no process group behind: gloo aborts at exit without barrier + destroy. Where
    DeepSpeed joined it, through DeepSpeed's own ``destroy_process_group``, which also drops the
    groups it keeps (``deepspeed.utils.groups``): the next DeepSpeed engine in this process (a
    sweep's next one-process job) would broadcast on the destroyed group ("Group ... is not
    registered")."""
    import torch.distributed as dist

    collect_here()
    if dist.is_available() and dist.is_initialized():
        if ok:
            dist.barrier()
        ds = sys.modules.get("deepspeed.comm")
        (ds if ds is not None and ds.is_initialized() else dist).destroy_process_group()


def teardown_at_exit() -> None:
    """``teardown`` for a process that trained outside ``run``: a Lightning user's own script after
    ``import strategies`` (``backends/lightning/registry.py`` registers this with ``atexit``), with
    our presets or Lightning's own strategies. Lightning destroys its process group at exit for
    NCCL only, and a plain script leaves its Trainer (module, DDP wrapper, optimizer, tensors) as
    cyclic garbage; both would otherwise reach interpreter finalization. There, a collection that
    some other thread runs (rank 0 always has one: Lightning's child-process observer) frees torch
    tensors with the GIL released; finalization kills that thread on its way back (pthread_exit),
    and the forced unwind through torch's C++ frames is std::terminate -- "terminate called
    without an active exception", SIGABRT, exit 134. So, from ``atexit`` (the main thread, before
    finalization begins): the garbage collected here, then the process group destroyed (with the
    garbage gone, nothing else holds it: its gloo threads are joined here). No barrier: a rank
    leaving on an error would wait at it for its peers until the collective timeout; destroying
    is local. Nothing to do when no process group is left (``run`` tore it down; one process)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    collect_here()
    dist.destroy_process_group()
