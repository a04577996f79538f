"""Experiment loggers as observers, the same on every backend, written by rank 0 only:
``logger=csv`` (``metrics.csv``, the resolved config beside it as ``config.yaml``),
``logger=tensorboard`` (event files under ``tensorboard/``; the resolved config a text
``config``), ``logger=wandb`` (one run per job; the resolved config is the run config, the
job's overrides its name -- Hydra's ``override_dirname`` -- and in a sweep the sweep is the
wandb group; offline unless ``logger.mode=online``; the memory and communication profiles
become tables at the last step).

Every ``trainer.log_every`` steps and the last step trained (``trainer.max_steps``, or the step
early stopping ended at) logs ``loss``, ``lr``, ``grad_norm`` (before
clipping), ``tokens_seen``, ``step_seconds`` and ``tokens_per_second`` of that step; each validation
``val_loss`` and ``val_perplexity`` (csv: the same file, its own row), and with
``callbacks.samples`` its completions (TensorBoard: a text table ``samples``; wandb: a table
``samples``; csv: none, report.json has them). Secrets stay out: the
config logged is the job's config (no environment), and wandb is given its settings explicitly.

A resumed run continues the same record: metrics.csv keeps its rows up to the checkpoint's step
and appends; TensorBoard purges the events after that step (a run killed past its last
checkpoint logged steps it now runs again); wandb resumes the run whose id the run directory
keeps (``wandb-run-id``), where W&B itself ignores steps it already has.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from observers.base import Ended, Engine, Observer, Selection, learning_rate, observer
from observers.files import atomic_write_text, named_error
from core.errors import ConfigError

LOGGERS: dict[str, Callable[[Selection], Observer]] = {}
"""``logger.name`` -> the factory of its logger."""


def logger(name: str) -> Callable[[Callable[[Selection], Observer]], Callable[[Selection], Observer]]:
    """Decorator: this factory builds the logger ``logger=<name>`` selects (``conf/logger/<name>.yaml``)."""

    def register(factory: Callable[[Selection], Observer]) -> Callable[[Selection], Observer]:
        LOGGERS[name] = factory
        return factory

    return register


@observer("logger", order=90)
def _selected(s: Selection) -> Observer | None:
    """The logger ``logger=`` picks, if any."""
    if s.job.logger is None:
        return None
    chosen = LOGGERS[s.job.logger.name](s)
    chosen.samples = s.chosen.get("samples")  # (callbacks.samples: each block, after it ran)
    chosen.every, chosen.last = s.job.trainer.log_every, s.job.trainer.max_steps
    return chosen


class StepLogger(Observer):
    """Collects each step's scalars and hands them to ``write`` (rank 0). Whatever ``open``,
    ``write`` and ``close`` fail to write is one line (``cannot_write``)."""

    name = ""  # logger=<name>
    where = Path()  # the file or directory being written (an error that names no file names this)

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.rank0 = False
        self._t0 = self._lr = 0.0
        self.resumed: int | None = None  # the checkpoint's step, when this run resumed
        self.samples: Any = None  # observers/samples.py's observer, when callbacks.samples is on
        self.every, self.last = 1, 0  # trainer.log_every, trainer.max_steps
        self._unlogged: tuple[int, float, float] | None = None  # (step, loss, seconds) not written yet

    def on_resume(self, engine: Engine, step: int, history: dict[str, Any]) -> None:
        self.resumed = step

    def on_train_start(self, engine: Engine, step: int) -> None:
        self.rank0 = engine.rank == 0
        if self.rank0:
            with self.writing():
                self.open()

    def on_step_start(self, engine: Engine, step: int) -> None:
        self._t0 = time.perf_counter()

    def on_before_optimizer_step(self, engine: Engine, step: int) -> None:
        self._lr = learning_rate(engine)

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        if self.rank0:
            self._unlogged = (step, loss, time.perf_counter() - self._t0)
            if step % self.every == 0 or step == self.last:
                self._write_step(engine)

    def on_train_end(self, engine: Engine) -> None:
        if self.rank0 and self._unlogged is not None:  # stopped early, between two logged steps
            self._write_step(engine)

    def _write_step(self, engine: Engine) -> None:
        """The last step that ended (``_unlogged``); the engine still holds its gradient norm."""
        (step, loss, seconds), self._unlogged = self._unlogged, None
        norm = engine.grad_norm()
        with self.writing():
            self.write(step, {"loss": loss, "lr": self._lr, "tokens_seen": step * self.tokens_per_step,
                              **({"grad_norm": norm} if norm is not None else {}),
                              "step_seconds": seconds,
                              "tokens_per_second": self.tokens_per_step / max(seconds, 1e-9)})

    def on_validation_end(self, engine: Engine, step: int, metrics: dict[str, Any]) -> None:
        if self.rank0:
            with self.writing():
                self.write(step, {"val_loss": metrics["loss"], "val_perplexity": metrics["perplexity"]})
                if self.samples is not None and self.samples.latest:
                    self.write_samples(step, self.samples.latest)

    def on_report(self, engine: Ended, report: dict[str, Any]) -> None:
        if self.rank0:
            with self.writing():
                self.close(report)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around this logger's own I/O: an OSError in it is ``cannot_write``'s one line."""
        try:
            yield
        except OSError as e:
            if (said := cannot_write(self.name, e, self.written())) is e:
                raise
            raise said from e

    def written(self) -> Path:
        """The file (or directory) being written, for an error that names none."""
        return self.where

    def open(self) -> None: ...

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def write_samples(self, step: int, block: list[dict[str, Any]]) -> None:
        """One validation's ``{step, prompt, completion}`` (callbacks.samples); a logger that
        shows no text skips them (csv: report.json has them)."""

    def close(self, report: dict[str, Any]) -> None: ...


class CSVLog(StepLogger):
    name = "csv"

    def __init__(self, tokens_per_step: int, out: Path, config: dict[str, Any]):
        super().__init__(tokens_per_step)
        self.path, self.config = out / "metrics.csv", config
        self.where = self.path
        self._file: Any = None
        self._writer: Any = None

    COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens_seen", "step_seconds", "tokens_per_second", "val_loss",
               "val_perplexity")

    def open(self) -> None:
        kept: list[dict[str, str]] = []
        if self.resumed is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= self.resumed]
        head = io.StringIO()
        writer = csv.DictWriter(head, fieldnames=list(self.COLUMNS), restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept)
        self.where = self.path.with_name("config.yaml")
        atomic_write_text(self.where, config_yaml(self.config))
        self.where = self.path
        atomic_write_text(self.path, head.getvalue())  # the header and the rows kept, then append
        self._file = open(self.path, "a", newline="")  # noqa: SIM115  (closed in close())
        self._writer = csv.DictWriter(self._file, fieldnames=list(self.COLUMNS), restval="")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._writer.writerow({"step": step, **scalars})
        self._file.flush()

    def close(self, report: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.close()


@logger("csv")
def _csv(s: Selection) -> Observer:
    return CSVLog(s.job.tokens_per_step, s.out, s.job.meta()["config"])


class TensorBoardLog(StepLogger):
    name = "tensorboard"

    def __init__(self, tokens_per_step: int, out: Path, config: dict[str, Any]):
        super().__init__(tokens_per_step)
        self.dir, self.config = out / "tensorboard", config
        self._writer: Any = None

    def written(self) -> Path:
        """This process's event file (named by time, host and pid: the newest), else the directory."""
        with contextlib.suppress(OSError):
            if mine := sorted(self.dir.glob(f"events.out.tfevents.*.{os.getpid()}.*")):
                return mine[-1]
        return self.dir

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if self.resumed is None else self.resumed + 1
        self._writer = SummaryWriter(log_dir=str(self.dir), purge_step=purge)
        # the job's config as a text (TEXT tab, tag "config"; a resumed run's at its first step,
        # which the purge keeps): a markdown code block, one line per key
        code = "".join(f"    {line}\n" for line in config_yaml(self.config).splitlines())
        self._writer.add_text("config", code, self.resumed or 0)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(_tag(key), value, step)

    def write_samples(self, step: int, block: list[dict[str, Any]]) -> None:
        from observers.samples import markdown

        self._writer.add_text("samples", markdown(block), step)

    def close(self, report: dict[str, Any]) -> None:
        self._writer.flush()  # (raises what the writer's thread failed to write; close() does not)
        self._writer.close()


@logger("tensorboard")
def _tensorboard(s: Selection) -> Observer:
    return TensorBoardLog(s.job.tokens_per_step, s.out, s.job.meta()["config"])


class WandbLog(StepLogger):
    name = "wandb"

    def __init__(self, tokens_per_step: int, out: Path, *, project: str, mode: str,
                 config: dict[str, Any], group: str | None, name: str | None = None):
        super().__init__(tokens_per_step)
        self.out, self.project, self.mode, self.config, self.group = out, project, mode, config, group
        self.run_name = name  # the job's overrides (None: W&B picks a name)
        self._run: Any = None

    def open(self) -> None:
        import wandb

        kept = self.where = self.out / "wandb-run-id"
        resume = self.resumed is not None and kept.is_file()
        run_id = kept.read_text().strip() if resume else uuid.uuid4().hex[:12]
        if not resume:  # (first: a directory that takes no file fails here, before W&B starts)
            atomic_write_text(kept, run_id + "\n")
        self.where = self.out / "wandb"
        self._run = wandb.init(project=self.project, mode=self.mode, dir=str(self.out),
                               config=self.config, group=self.group, name=self.run_name,
                               reinit="finish_previous", id=run_id, resume="allow" if resume else None,
                               settings=wandb.Settings(console="off", x_disable_stats=True))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log({_tag(k): v for k, v in scalars.items()}, step=step)

    def write_samples(self, step: int, block: list[dict[str, Any]]) -> None:
        import wandb

        rows = [[r["step"], r["prompt"], r["completion"]] for r in block]
        self._run.log({"samples": wandb.Table(columns=["step", "prompt", "completion"], data=rows)}, step=step)

    def close(self, report: dict[str, Any]) -> None:
        import wandb

        tables = {name: wandb.Table(columns=columns, data=rows)
                  for name, (columns, rows) in profile_tables(report).items()}
        if tables:  # one call, at the last optimizer step: a call without a step after the first
            # opens a step the run never took, and a resumed run continues after it (its first step lost)
            self._run.log(tables, step=report.get("steps"))
        self._run.finish()


@logger("wandb")
def _wandb(s: Selection) -> Observer:
    job = s.job
    return WandbLog(job.tokens_per_step, s.out, project=job.logger.project, mode=job.logger.mode,
                    config=job.meta()["config"], group=job.sweep, name=job.name)


UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
"""A place this user cannot write: a read-only filesystem, permissions."""
IN_THE_WAY = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR)
"""A file where the logger's directory goes (or a directory where its file goes)."""


def cannot_write(name: str, error: OSError, where: Path) -> OSError | ConfigError:
    """What logger=``name`` failed to write, in one line: a full disk (or quota) an ``OSError``
    naming the logger and the file (exit 1, as every full disk: train.py, the launcher); a place it
    cannot write -- read-only, not permitted, a file where its directory goes -- a ``ConfigError``
    naming the logger, the path, the cause and the fix (exit 2, as a run directory that cannot be
    written). ``where``: the path for an error that names none. Any other error is left as it is."""
    named = error.filename2 or error.filename
    path = Path(os.fsdecode(named)) if named else where
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return named_error(error, path, f"logger={name} writing")
    key = f"logger={name} cannot write {path}"
    if error.errno in UNWRITABLE:
        return ConfigError(f"{key}: {os.strerror(error.errno)}; point hydra.run.dir at a directory this user "
                           "can write, or logger=null")
    if error.errno not in IN_THE_WAY:
        return error
    if error.errno == errno.EISDIR:
        found = f"{path} is a directory, not a file"
    else:  # (the nearest existing path on the way: a file)
        here = next((p for p in (path, *path.parents) if p.exists()), path)
        found = f"{here} is a file, not a directory"
    return ConfigError(f"{key}: {found}; remove or rename it, or point hydra.run.dir at another directory")


def config_yaml(config: dict[str, Any]) -> str:
    """The job's resolved config as YAML (as each checkpoint's ``config.yaml``)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config))


def _tag(key: str) -> str:
    """``loss`` -> ``train/loss``, ``val_loss`` -> ``val/loss``."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def profile_tables(report: dict[str, Any]) -> dict[str, tuple[list[str], list[list[Any]]]]:
    """The memory and communication profiles as (columns, rows) tables (the communication per
    optimizer step)."""
    tables = {}
    memory = report.get("memory", {}).get("ranks") or []
    if memory:
        cols = ["rank", "params", "grads", "optimizer", "activations", "peak_rss"]
        tables["memory"] = (cols, [[r.get(c) for c in cols] for r in memory])
    comm = report.get("communication", {}).get("by_group") or {}
    if comm:
        rows = [[g, k, v["count"], v["bytes"], v["wire_bytes"]]
                for g, kinds in comm.items() for k, v in kinds.items()]
        # (report.json's communication.by_group: each an average over the optimizer steps)
        tables["communication"] = (["group", "kind", "count_per_step", "bytes_per_step", "wire_bytes_per_step"], rows)
    return tables
