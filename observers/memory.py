"""Memory profile: what each rank really holds, measured from live objects.

- ``params``, ``grads``, ``optimizer``: bytes of model states this rank holds (local shards;
  the engine view's ``held_bytes`` knows where its engine keeps each). Gradients are counted just
  before the first optimizer step, parameters and optimizer state right after it.
- ``activations``: bytes saved for backward by one micro-batch's forward pass (the first),
  counted with autograd's saved-tensor hooks (``parallel.memory.SavedTensors``): every
  distinct storage saved, parameters and module buffers (and views of them) excluded, at the
  live peak (a pipeline's first schedule runs forward and backward of every micro-batch inside
  that window: the most its chunks held at once). With activation checkpointing it falls to the
  blocks' inputs (selective: and the outputs its policy keeps; None, with one warning, on a torch
  whose cache of them cannot be read: parallel/checkpointing.py ``sac_kept``).
- ``peak_rss``: this job's peak resident memory (``VmHWM``; see ``peak_rss``), from the
  observer's creation, before the backend builds anything (``job_peak_start``): a sweep runs its
  one-process jobs in its own process, one after another, and the process's high-water mark
  would be the largest job's so far. Where the kernel offers no reset it is the process's, and
  ``peak_rss_before`` states the peak it had when the job began (said once, in a process's
  second job).
- ``peak_rss_growth``: how far a training step's resident memory rises above what the step
  leaves behind -- its peak (reset at the step's start, Linux ``/proc/self/clear_refs``) minus
  the RSS once its update is done, when every state exists and the transients are freed: the
  activations, the loss backward, gathered units, the step's copies, less the gradients that do
  not exist yet at backward's start (the planner's ``memory.growth``). ``peak_rss_run``: the same
  peak above the RSS the process had before the model was built (the observer is made before the
  backend builds anything): model, engine and step together, the planner's ``memory.total``
  plus the runtime's own (gloo, DeepSpeed's CPU accelerator: tens to ~150 MB, as the CUDA
  context on a GPU). Both skip the first step (one-time allocations, the optimizer state
  appearing) when the run has more, and keep the largest later step; None where the kernel
  offers no reset. RSS follows the live bytes only as far as the allocator returns freed memory
  (glibc's default dynamic mmap threshold keeps freed 1-30 MB tensors in its heap), so the model
  build and the first ``MEASURED_STEPS`` steps allocate exactly (``allocate_exactly``) and later
  steps in the rank's steady state (a heap that is never trimmed by itself).
- On GPU, ``cuda``: peak allocated and reserved bytes per phase -- forward, backward, optimizer
  step -- over the run (``torch.cuda`` peak counters, reset at each phase boundary), and on
  request (``callbacks.memory.snapshot=true``) a CUDA memory snapshot of the first steps per
  rank, ``memory_snapshot_rank<r>.pickle``, which https://pytorch.org/memory_viz opens.

Report key ``memory``: ``{"ranks": [{"rank", "params", "grads", "optimizer", "activations",
"peak_rss", "peak_rss_growth", "peak_rss_run", ["peak_rss_before"], ["cuda"]}, ...],
"predicted": {...}}`` (bytes;
``predicted``: the planner's per-device numbers for the same preset, when planned).
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.knobs import knob
from observers.base import Engine, Observer, Selection, observer

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from parallel.memory import SavedTensors

PHASES = ("forward", "backward", "optimizer")


def peak_rss() -> int:
    """This process's own peak resident bytes: Linux's ``VmHWM`` (/proc/self/status), the
    high-water mark ``reset_peak_rss`` resets. Not ``getrusage``'s ``ru_maxrss``: Linux carries
    the parent's peak across fork and exec into it (a train.py started by a 2 GB notebook or
    test runner reports 2 GB) and ``clear_refs`` does not reset it. ``ru_maxrss`` only where
    there is no /proc (macOS reports bytes)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    import sys

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def current_rss() -> int | None:
    """Resident bytes now (Linux ``/proc/self/statm``); None elsewhere."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _libc():
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_chosen = False
"""Whether this process has set its allocator (``allocate_exactly``)."""


def allocate_exactly(exact: bool) -> None:
    """glibc only (a no-op elsewhere). With ``exact`` (the memory observer's measured steps),
    tensors over 64 KiB get pages of their own (``M_MMAP_THRESHOLD``, what
    ``MALLOC_MMAP_THRESHOLD_=65536`` sets), the heap is trimmed past glibc's default 128 KiB and
    the freed pages go back to the kernel now (``release_freed``), so RSS follows the live bytes.

    Without (every rank's steady state: ``backends.run`` and the calibration set it first; a
    user's own script on a preset gets it from the preset's Lightning strategy or from
    ``stratagem_accelerator``: ``allocate_steadily``), the mmap threshold is glibc's ceiling (32
    MiB) and the heap is never trimmed by itself: a training step frees what the next one
    allocates again, so giving it back to the kernel only buys a page fault per page on the next
    step. Setting either threshold turns glibc's dynamic rule off, and neither its defaults nor a
    fixed trim threshold keep a large step: a trim threshold left at 128 KiB gave each step's
    freed heap back (3.7x glibc's page faults on a CPU transformer step, 15% of its CPU time), and
    at 64 MiB a ZeRO-3 step, whose gathered parameters, gradients and reduce-scatter buffer free
    together above it, still faulted ~5,000 pages a step back in on 2 ranks (glibc's defaults:
    14,000; never trimmed: 20; tests/test_allocator.py, docs/PLANNER.md). The peak a step reaches
    is the same either way: only the give-back between steps goes."""
    global _chosen
    _chosen = True
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(-3, 65536 if exact else 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 << 10 if exact else -1)  # M_TRIM_THRESHOLD (-1: never, man mallopt)
    if exact:
        release_freed()


def allocate_steadily() -> None:
    """The steady state for a process whose allocator nobody chose yet: a user's own script on
    a preset (the preset's Lightning strategy at ``setup_environment``, ``stratagem_accelerator``).
    A train.py rank chose already (``backends.run``, then the memory observer, whose exact mode
    must hold through the build it measures), so it is left as it is."""
    if not _chosen:
        allocate_exactly(False)


def release_freed() -> None:
    """Hand the heap's free pages back to the kernel now (glibc's ``malloc_trim``; a no-op
    elsewhere). The steady state never trims by itself, so each backend calls this once, after
    the build and a checkpoint's restore: what those freed for good (a loaded state's tensors
    under 32 MiB, the engine's build copies) would otherwise stay resident through the run (the
    Lightning backend's call is its strategies' ``on_train_start``, a user's script's too)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


MEASURED_STEPS = 2
"""Steps whose RSS growth is measured, the first (one-time allocations) aside: one step
allocating exactly costs a page fault per fresh page (~40% of a gpt_small CPU step), so only the
second step pays it; the throughput median (first step excluded) keeps it an outlier."""


def reset_peak_rss() -> bool:
    """Start a new peak: the kernel sets the process's high-water mark to its current RSS
    (Linux >= 4.0, ``echo 5 > /proc/self/clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_jobs = 0
"""Jobs whose memory this process measured (``job_peak_start``): a sweep's one-process jobs."""


def job_peak_start() -> int | None:
    """Start this job's peak RSS: the process's high-water mark reset (``reset_peak_rss``): None.
    Where the kernel offers no reset, the stated baseline: the process's peak so far, which this
    job's ``peak_rss`` cannot go under (an earlier job's in this process), returned and, in a
    process's second job, said."""
    global _jobs
    _jobs += 1
    if reset_peak_rss():
        return None
    before = peak_rss()
    if _jobs > 1:
        log.warning("peak_rss: this system cannot reset a process's peak RSS (/proc/self/clear_refs), "
                    "and this process ran a job before this one: this job's peak_rss is the process's, "
                    "%d MiB before it began (report.json memory.ranks[].peak_rss_before) -- where it is "
                    "not above that, the figure is an earlier job's", before >> 20)
    return before


def all_gather(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order (just ``[obj]`` without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class CudaPhases:
    """Peak allocated/reserved bytes per phase, read and reset at each phase boundary."""

    def __init__(self) -> None:
        self.peaks = {p: {"allocated": 0, "reserved": 0} for p in PHASES}

    def close(self, phase: str | None) -> None:
        """The phase that just ended (None: only reset)."""
        import torch

        if phase is not None:
            p = self.peaks[phase]
            p["allocated"] = max(p["allocated"], torch.cuda.max_memory_allocated())
            p["reserved"] = max(p["reserved"], torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()


class MemoryProfile(Observer):
    def __init__(self, predicted: dict[str, int] | None = None, *, out: Path | None = None,
                 snapshot_steps: int = 0):
        """``predicted``: the planner's per-device bytes; ``snapshot_steps``: record a CUDA
        memory snapshot of that many first steps."""
        self.predicted = predicted
        self.out, self.snapshot_steps = out, snapshot_steps
        self.held: dict[str, int] = {}
        self.ranks: list[dict[str, Any]] = []
        self._saved: SavedTensors | None = None
        self._cuda: CudaPhases | None = None
        self._phase: str | None = None
        # RSS before the model exists (observers are made before the backend builds anything)
        self._baseline = current_rss()
        # Allocate exactly from here, not from the first step: a buffer the build or the first
        # step made inside glibc's heap (under its dynamic threshold, up to 32 MiB) and a
        # measured step frees stays resident beside its replacement's fresh pages, so RSS would
        # count both (zero3_offload on 2 ranks: 1.09-1.12 of the plan, 0.99 exact from the start)
        allocate_exactly(True)
        # this job's peak from here, what an earlier job in this process freed handed back just
        # now (a sweep's: its steady heap is never trimmed by itself)
        self._before = job_peak_start()
        self._lifetime = 0  # the process's peak, across the per-step resets
        self._step_peaks: list[tuple[int, int]] = []  # each step's peak over its end, over the baseline
        self._resets = False
        self.first_step_only = False
        """Whether the RSS growth measured is the first step's alone (a one-step run): its update
        creates the optimizer state, so what it leaves is not what a later step's leaves."""

    def _held(self, engine: Engine, what: str) -> int:
        return engine.held_bytes(what)

    def _enter(self, phase: str | None) -> None:
        if self._cuda is not None:
            self._cuda.close(self._phase)
        self._phase = phase

    def on_train_start(self, engine: Engine, step: int) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._cuda = CudaPhases()
            self._enter(None)
            if self.snapshot_steps:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        elif self.snapshot_steps and engine.rank == 0:
            log.info("callbacks.memory.snapshot: a CUDA memory snapshot, and this run has no CUDA "
                     "device: none is written (RSS and the saved tensors are measured as always)")

    def on_step_start(self, engine: Engine, step: int) -> None:
        if self._baseline is not None:
            self._lifetime = max(self._lifetime, peak_rss())
            self._resets = len(self._step_peaks) < MEASURED_STEPS
            if self._resets:
                allocate_exactly(True)
                self._resets = reset_peak_rss()

    def on_forward_start(self, engine: Engine, step: int) -> None:
        self._enter("forward")
        if "activations" not in self.held and self._saved is None:
            from parallel.memory import SavedTensors

            self._saved = SavedTensors(buffers=engine.model.buffers()).__enter__()

    def on_forward_end(self, engine: Engine, step: int) -> None:
        self._enter("backward")
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self.held["activations"] = self._saved.bytes
            self._saved = None

    def on_before_optimizer_step(self, engine: Engine, step: int) -> None:
        self._enter("optimizer")
        if "grads" not in self.held:
            self.held["grads"] = self._held(engine, "grads")

    def on_step_work_end(self, engine: Engine, step: int) -> None:
        self._enter(None)
        if self._resets and self._baseline is not None:
            peak = peak_rss()
            allocate_exactly(True)  # (returns what the step freed)
            self._step_peaks.append((peak - (current_rss() or peak), peak - self._baseline))
            if len(self._step_peaks) == MEASURED_STEPS:
                allocate_exactly(False)
        if "optimizer" not in self.held:
            self.held["params"] = self._held(engine, "params")
            self.held["optimizer"] = self._held(engine, "optimizer")
        if self.snapshot_steps and step + 1 == self.snapshot_steps and self._cuda is not None:
            self._dump(engine)

    def _dump(self, engine: Engine) -> None:
        import torch

        torch.cuda.memory._dump_snapshot(str(self.out / f"memory_snapshot_rank{engine.rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)

    def on_train_end(self, engine: Engine) -> None:
        import torch

        if self.snapshot_steps and self._cuda is not None and torch.cuda.memory._snapshot()["segments"]:
            self._dump(engine)  # a run shorter than snapshot_steps
        steady = self._step_peaks[1:] or self._step_peaks  # the first step aside, when others ran
        self.first_step_only = len(self._step_peaks) == 1
        mine = {"rank": engine.rank, **self.held, "peak_rss": max(self._lifetime, peak_rss()),
                "peak_rss_growth": max((g for g, _ in steady), default=None),
                "peak_rss_run": max((r for _, r in steady), default=None)}
        if self._before is not None:
            mine["peak_rss_before"] = self._before
        if self._cuda is not None:
            mine["cuda"] = self._cuda.peaks
        self.ranks = all_gather(mine)

    def report(self) -> dict[str, Any]:
        return {"memory": {"ranks": self.ranks, "predicted": self.predicted}}


@dataclass
class MemoryObserverConfig:
    enabled: bool = True
    """Bytes each rank holds (params, grads, optimizer, activations); on GPU, peaks per phase."""
    snapshot: bool = False
    """GPU: record a CUDA memory snapshot of the first ``snapshot_steps`` steps per rank."""
    snapshot_steps: int = knob(3, min=1)
    """How many first steps the snapshot records."""


@dataclass
class MemoryKnobs:
    memory: MemoryObserverConfig = field(default_factory=MemoryObserverConfig)


@observer("memory", order=30, knobs=MemoryKnobs)
def _selected(s: Selection) -> Observer | None:
    """``callbacks.memory.enabled`` (``snapshot``, ``snapshot_steps``: the CUDA snapshot)."""
    cfg = s.job.callbacks.memory
    if not cfg.enabled:
        return None
    return MemoryProfile(s.plan and s.plan["memory"], out=s.out,
                         snapshot_steps=cfg.snapshot_steps if cfg.snapshot else 0)
