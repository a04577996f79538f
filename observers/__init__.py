"""Observers: the run's record, memory and communication profiles, throughput, the planner's
prediction beside what was measured, plots, loggers and progress (a bar, or log lines) -- plain classes that
every backend feeds through the same hooks (observers/base.py). The ``callbacks`` config group
selects them; ``logger`` picks a logger."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from observers.base import Engine, Observer, Observers
from observers.compare import Comparison
from observers.memory import MemoryProfile
from observers.progress import Progress
from observers.report import LossLog
from observers.startup import StartupTimes
from observers.throughput import Throughput

if TYPE_CHECKING:
    from recipes.job import Job

__all__ = ["Engine", "LossLog", "MemoryProfile", "Observer", "Observers", "Progress",
           "StartupTimes", "Throughput", "build"]


def build(job: Job, out: Path, plan: dict[str, Any] | None = None) -> Observers:
    """The observers ``job.callbacks`` and ``job.logger`` select; ``plan``: the planner's
    prediction for this run (``planner.plan_dict``), reported next to what is measured."""
    cb, tokens = job.callbacks, job.tokens_per_step
    chosen: list[Observer] = [LossLog(tokens), StartupTimes()]
    if cb.progress_bar or cb.log_every:  # the bar on a terminal, else a line every log_every steps
        chosen.append(Progress(job.trainer.max_steps, tokens, bar=cb.progress_bar, log_every=cb.log_every))
    memory = comm = None
    if cb.memory.enabled:
        memory = MemoryProfile(plan and plan["memory"], out=out,
                               snapshot_steps=cb.memory.snapshot_steps if cb.memory.snapshot else 0)
        chosen.append(memory)
    if cb.communication:
        from observers.comm import CommunicationProfile

        comm = CommunicationProfile(job.strategy.world_role(job.mesh))
        chosen.append(comm)
    throughput = None
    if cb.throughput:
        compute = (plan or {}).get("compute") or {}
        calibrated = "planner.calibrate" in str(compute.get("peak_source", ""))
        throughput = Throughput(tokens, job.batch.global_size, flops_per_token=job.model.flops_per_token(),
                                precision=job.run.precision,
                                peak=(compute["peak_tflops"], compute["peak_source"]) if calibrated else None)
        chosen.append(throughput)
    if getattr(job.model, "is_moe", False):
        from observers.moe import MoEStats

        chosen.append(MoEStats())
    if cb.compare and plan is not None:
        chosen.append(Comparison(plan, memory, comm, throughput))
    if cb.plots:
        from observers.plots import Plots

        chosen.append(Plots(out))
    if job.logger is not None:
        chosen.append(_logger(job, out))
    meta = job.meta() | {"observers": [type(o).__name__ for o in chosen]}
    if plan is not None:
        meta["plan"] = {k: plan[k] for k in ("fits", "communication", "step_seconds", "chosen_by",
                                             "tight", "margin", "device_memory") if k in plan}
    return Observers(chosen, meta=meta, report_path=out / "report.json" if cb.report else None)


def _logger(job: Job, out: Path) -> Observer:
    from observers.loggers import CSVLog, TensorBoardLog, WandbLog

    tokens, name = job.tokens_per_step, job.logger.name
    if name == "csv":
        return CSVLog(tokens, out)
    if name == "tensorboard":
        return TensorBoardLog(tokens, out)
    return WandbLog(tokens, out, project=job.logger.project, mode=job.logger.mode,
                    config=job.meta()["config"], group=job.sweep)
