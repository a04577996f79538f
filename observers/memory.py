"""Memory profile: what each rank really holds, measured from live objects.

- ``params``, ``grads``, ``optimizer``: bytes of model states this rank holds (local shards;
  the engine view's ``held_bytes`` knows where its engine keeps each). Gradients are counted just
  before the first optimizer step, parameters and optimizer state right after it.
- ``activations``: bytes saved for backward by one micro-batch's forward pass (the first),
  counted with autograd's saved-tensor hooks (``strategies.memory.SavedTensors``): every
  distinct storage saved, parameters and module buffers (and views of them) excluded. With
  activation checkpointing it falls to the blocks' inputs.
- ``peak_rss``: the process's peak resident memory.
- On GPU, ``cuda``: peak allocated and reserved bytes per phase -- forward, backward, optimizer
  step -- over the run (``torch.cuda`` peak counters, reset at each phase boundary), and on
  request (``callbacks.memory.snapshot=true``) a CUDA memory snapshot of the first steps per
  rank, ``memory_snapshot_rank<r>.pickle``, which https://pytorch.org/memory_viz opens.

Report key ``memory``: ``{"ranks": [{"rank", "params", "grads", "optimizer", "activations",
"peak_rss", ["cuda"]}, ...], "predicted": {...}}`` (bytes; ``predicted``: the planner's
per-device numbers for the same preset, when planned).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

from observers.base import Engine, Observer

if TYPE_CHECKING:
    from strategies.memory import SavedTensors

PHASES = ("forward", "backward", "optimizer")


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

    def on_forward_start(self, engine: Engine, step: int) -> None:
        self._enter("forward")
        if "activations" not in self.held and self._saved is None:
            from strategies.memory import SavedTensors

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
        mine = {"rank": engine.rank, **self.held, "peak_rss": peak_rss()}
        if self._cuda is not None:
            mine["cuda"] = self._cuda.peaks
        self.ranks = all_gather(mine)

    def report(self) -> dict[str, Any]:
        return {"memory": {"ranks": self.ranks, "predicted": self.predicted}}
