"""The run's record: the global-batch loss of every optimizer step, and the loop's wall time.

Report keys (documented in README): ``steps``, ``losses``, ``lrs`` (the learning rate of each
step), ``grad_norms`` (each step's global gradient norm before clipping), ``final_loss``, ``wall_seconds``, ``tokens_per_second``, ``validation`` (one ``{step, loss, perplexity, samples}`` per validation;
empty without a validation split), ``best`` (the validation with the lowest loss: ``{step,
val_loss, path}``, path its checkpoint directory when one exists -- trainer.keep_best keeps it;
null without validations), ``stopped`` (why the run ended: ``{reason: max_steps, step}`` or
``{reason: early_stopping, step, best_step, best_val_loss, patience, min_delta}``;
recipes/stopping.py). The backend computes each step's loss (the mean over all its
micro-batches on all data-parallel ranks) and hands it to ``on_step_end``. A resumed run starts
from the record its checkpoint carries: ``losses`` and ``validation`` cover the whole run;
``wall_seconds`` and ``tokens_per_second`` this attempt.

On the console (rank 0): each validation as it is computed, and at the end (``closing``, which
train.py logs) the planner's prediction beside what was measured, then ``summary``, the run's last
line: steps, final loss, validation loss, tokens/s, peak memory, the report.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from observers.base import Engine, Observer, Selection, learning_rate, observer
from recipes import stopping

log = logging.getLogger(__name__)


class LossLog(Observer):
    def __init__(self, tokens_per_step: int, trainer: Any = None, out: Path | None = None):
        self.tokens_per_step, self.trainer, self.out = tokens_per_step, trainer, out
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.grad_norms: list[float | None] = []
        self._lr = 0.0
        self.validation: list[dict[str, Any]] = []
        self._start = self._end = 0.0
        self._first = 0  # losses recorded before this attempt

    def on_resume(self, engine: Engine, step: int, history: dict[str, Any]) -> None:
        # the record up to the checkpoint's step; a later kill may have logged more, which the
        # resumed run computes again
        self.losses = [float(x) for x in history.get("losses", [])][:step]
        self.lrs = [float(x) for x in history.get("lrs", [])][:step]
        self.grad_norms = list(history.get("grad_norms", []))[:step]
        self.validation = [v for v in history.get("validation", []) if v["step"] <= step]
        self._first = len(self.losses)

    def history(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "lrs": list(self.lrs), "grad_norms": list(self.grad_norms),
                "validation": list(self.validation)}

    def on_train_start(self, engine: Engine, step: int) -> None:
        self._start = time.perf_counter()

    def on_before_optimizer_step(self, engine: Engine, step: int) -> None:
        self._lr = learning_rate(engine)

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        self.losses.append(float(loss))
        self.lrs.append(self._lr)
        self.grad_norms.append(engine.grad_norm())

    def on_validation_end(self, engine: Engine, step: int, metrics: dict[str, Any]) -> None:
        self.validation.append(dict(metrics))
        if engine.rank == 0:
            log.info("validation at step %d: loss %.4f, perplexity %.2f (%d samples)", step,
                     metrics["loss"], metrics["perplexity"], metrics.get("samples", 0))
            if self.trainer is not None and (s := stopping.stopped(
                    self.validation, self.trainer, step))["reason"] == stopping.EARLY_STOPPING:
                log.info("%s", stopping.line(s, self.validation))

    def on_train_end(self, engine: Engine) -> None:
        self._end = time.perf_counter()

    def report(self) -> dict[str, Any]:
        wall, ran = self._end - self._start, len(self.losses) - self._first
        return {"steps": len(self.losses), "losses": self.losses, "lrs": self.lrs,
                "grad_norms": self.grad_norms,
                "final_loss": self.losses[-1] if self.losses else None, "wall_seconds": wall,
                "validation": self.validation, **self._ending(),
                "tokens_per_second": ran * self.tokens_per_step / wall if wall > 0 else 0.0}


    def _ending(self) -> dict[str, Any]:
        """``best`` and ``stopped``."""
        if self.trainer is None:
            return {}
        best = stopping.judge(self.validation).best
        if best is not None:
            # (checkpoints.store.path_for's name: observers do not import checkpoints/)
            where = self.out / "checkpoints" / f"step{best['step']}" if self.out is not None else None
            best = {"step": int(best["step"]), "val_loss": float(best["loss"]),
                    "path": str(where) if where is not None and where.is_dir() else None}
        return {"best": best, "stopped": stopping.stopped(self.validation, self.trainer, len(self.losses))}


def _bytes(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def peak_memory(report: dict[str, Any]) -> str | None:
    """The largest peak of any rank: CUDA allocated on GPU, else the process's resident memory;
    None without the memory observer."""
    ranks = (report.get("memory") or {}).get("ranks") or []
    cuda = [max(p["allocated"] for p in r["cuda"].values()) for r in ranks if r.get("cuda")]
    if cuda:
        return f"{_bytes(max(cuda))} CUDA allocated"
    rss = [r["peak_rss"] for r in ranks if r.get("peak_rss")]
    return f"{_bytes(max(rss))} RSS" if rss else None


def summary(report: dict[str, Any], path: Path | None = None) -> str:
    """The run in one line: steps, final loss, the last validation loss, tokens/s (global), peak
    memory (the largest of any rank), the start-up by its largest phases when it took longer than
    the training (report key ``startup``, observers/startup.py) and where the report is."""
    parts = [f"done: {report['steps']} steps", f"final loss {report['final_loss']:.4f}"]
    if report.get("validation"):
        parts.append(f"val loss {report['validation'][-1]['loss']:.4f}")
    if (report.get("stopped") or {}).get("reason") == stopping.EARLY_STOPPING:
        parts.append(f"stopped early (best val loss {report['stopped']['best_val_loss']:.4f} at step "
                     f"{report['stopped']['best_step']})")
    # the median step's (the throughput observer's) when measured: the first step's start-up aside
    measured = (report.get("throughput") or {}).get("tokens_per_second")
    rate = measured or report.get("tokens_per_second", 0)
    parts.append(f"{rate:,.0f} tokens/s" + ("" if measured else " (the whole loop's, first step included)"))
    t = report.get("throughput") or {}
    if t.get("mfu") is not None:
        parts.append(f"MFU {t['mfu']:.1%} = {t['mfu_formula']}")
    if (peak := peak_memory(report)) is not None:
        parts.append(f"peak memory {peak}")
    start, wall = report.get("startup"), report.get("wall_seconds")
    if start and wall is not None and start["total"] > wall:  # the run was mostly its start
        from observers.startup import line

        parts.append(f"{line(start)} > training {wall:.1f} s")
    if path is not None:
        parts.append(f"report {path}")
    return ", ".join(parts)


def closing(report: dict[str, Any], path: Path | None = None) -> list[str]:
    """What rank 0 logs at the end of a run: the planner's prediction beside what was measured
    (a table), then ``summary`` -- the last line."""
    from observers.compare import summary_lines

    table = report.get("predicted_vs_measured")
    lines = summary_lines(table) if table else []  # its legend says when step time is uncalibrated
    return (["predicted vs measured:\n" + "\n".join(lines)] if lines else []) + [summary(report, path)]


RECORD = ("report.json", "loss.png", "memory.png", "communication.png")
"""What a run writes when it ends (the hub's report, plots.py's figures): one attempt's record."""


def set_aside(run_dir: str | Path) -> Path | None:
    """Training starts again in ``run_dir``: an earlier attempt's record (``RECORD``) moves to
    ``run_dir/superseded-<time>/`` -- report.json first, each file by one rename -- so that
    report.json stands only for an attempt that finished (a failed one leaves none) and nothing
    is lost; every other file stays. The folder it went to; None when there was none."""
    run_dir = Path(run_dir)
    found = [run_dir / name for name in RECORD if (run_dir / name).is_file()]
    if not found:
        return None
    stamp, n = time.strftime("%Y%m%dT%H%M%S"), 1
    while True:
        aside = run_dir / (f"superseded-{stamp}" if n == 1 else f"superseded-{stamp}-{n}")
        try:
            aside.mkdir()
            break
        except FileExistsError:
            n += 1
    for f in found:
        f.rename(aside / f.name)
    log.info("the earlier attempt's %s moved to %s: this attempt writes its own when it ends",
             ", ".join(f.name for f in found), aside)
    return aside


@dataclass
class ReportKnobs:
    report: bool = True
    """Write report.json at the end of the run."""


@observer("report", order=0, knobs=ReportKnobs)
def _selected(s: Selection) -> Observer:
    """Always: the run's losses and wall time."""
    return LossLog(s.job.tokens_per_step, s.job.trainer, s.out)
