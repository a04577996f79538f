"""Observers: the run report, memory profile, throughput and progress bar, as plain classes that
every backend feeds through the same hooks (observers/base.py). The ``callbacks`` config group
selects them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from observers.base import Engine, Observer, Observers
from observers.memory import MemoryProfile
from observers.progress import ProgressBar
from observers.report import LossLog
from observers.throughput import Throughput

if TYPE_CHECKING:
    from recipes.job import Job

__all__ = ["Engine", "LossLog", "MemoryProfile", "Observer", "Observers", "ProgressBar",
           "Throughput", "build"]


def build(job: Job, out: Path, plan: dict[str, Any] | None = None) -> Observers:
    """The observers ``job.callbacks`` selects; ``plan``: the planner's prediction for this run
    (``planner.plan_dict``), reported next to what is measured."""
    cb, tokens = job.callbacks, job.tokens_per_step
    chosen: list[Observer] = [LossLog(tokens)]
    if cb.progress_bar:
        chosen.append(ProgressBar(job.trainer.max_steps, tokens))
    if cb.memory:
        chosen.append(MemoryProfile(job.strategy, plan and plan["memory"]))
    if cb.throughput:
        chosen.append(Throughput(tokens, job.batch.global_size))
    meta = job.meta()
    if plan is not None:
        meta["plan"] = {k: plan[k] for k in ("fits", "communication", "step_seconds")}
    return Observers(chosen, meta=meta, report_path=out / "report.json" if cb.report else None)
