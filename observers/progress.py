"""Progress on rank 0, counted in optimizer steps (not micro-batches); the same on every backend.

- stdout a terminal (and ``callbacks.progress_bar``): a progress bar with the loss and tokens/s
  of the last step.
- otherwise (``python train.py > run.log``, nohup, Slurm, Kubernetes, CI): one log line every
  ``callbacks.log_every`` steps, on the first step of the attempt and on the last, and at least
  every ``HEARTBEAT_SECONDS``: the last step's line when a step ended since the line before, else
  what is running and for how long -- a long step, a validation, what runs between steps (a
  checkpoint, the next batch) or after the last (finishing) --, so a log file never looks hung;
  both at the same beat when what runs is overdue (``OVERDUE`` mean steps since the last ended),
  so a stall shows at its first beat, and an overdue step's lines claim no ETA::

      step 20/300 (7%) | loss 3.2145 | lr 3.00e-04 | 41,235 tok/s | 0.199 s/step | ETA 0:00:56 | mem 812 MiB RSS
      validating after step 20/300: 0:01:00 since step 20 ended | last loss 3.2145 | ETA 0:00:56 | mem 812 MiB RSS
      step 22/300 still running: 0:01:04 since step 21 ended, overdue (0.201 s a step so far) | last loss 3.2101 | mem 812 MiB RSS

  step time and tokens/s are the mean of the steps since the step line before, each from its start
  to its end as metrics.csv's ``step_seconds`` (validations and checkpoints between steps left
  out); the ETA is the steps left times the mean wall-clock step of this attempt (validations and
  checkpoints in; its first step, which carries the warm-up, left out once there are others);
  memory is rank 0's: the CUDA caching allocator's reserved bytes on GPU, the resident set on CPU.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from core.knobs import knob

from observers.base import Engine, Observer, Selection, learning_rate, observer

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 60.0
"""The longest a log file goes without a progress line while training."""
OVERDUE = 4.0
"""What runs is overdue past this many mean steps since the last step ended (and at least half a
heartbeat): the heartbeat then says what runs at once, after the last step's pending line."""


def _bytes(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(max(seconds, 0.0))))


def memory_now() -> str | None:
    """This process's memory now, cheaply: CUDA reserved bytes once CUDA is in use, else the
    resident set (None where neither is known)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"{_bytes(torch.cuda.memory_reserved())} CUDA reserved"
    from observers.memory import current_rss

    rss = current_rss()
    return f"{_bytes(rss)} RSS" if rss is not None else None


class Progress(Observer):
    """The bar on a terminal, plain log lines elsewhere (module docstring); rank 0 only.

    ``bar``: show the bar when stdout is a terminal (``callbacks.progress_bar``); ``log_every``:
    a line every that many steps when the bar is not shown (0: no lines); ``interactive``: whether
    stdout is a terminal (None: ask ``sys.stdout`` when training starts); ``heartbeat``: the
    longest silence, in seconds."""

    _beating: Progress | None = None
    """The observer whose heartbeat runs in this process: a job that failed (no train end) is
    silenced when the next one starts, as a sweep's next job does."""

    def __init__(self, max_steps: int, tokens_per_step: int, *, bar: bool = True, log_every: int = 10,
                 interactive: bool | None = None, heartbeat: float = HEARTBEAT_SECONDS):
        self.max_steps, self.tokens_per_step = max_steps, tokens_per_step
        self.bar, self.log_every, self.interactive, self.heartbeat = bar, log_every, interactive, heartbeat
        self._progress = self._task = None
        self._last = 0.0
        # plain lines (written by the training thread and the heartbeat's, under the lock)
        self._lines = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lr = 0.0
        self._first = 0            # steps done before this attempt
        self._step = 0             # steps done
        self._loss: float | None = None
        self._started = 0.0        # when this attempt's training started
        self._ended = 0.0          # when the last step ended (or training started)
        self._began: float | None = None  # when the running step started (None: between steps)
        self._busy = 0.0           # seconds inside steps (start to end) this attempt
        self._validating = False
        self._said = 0.0           # when the last line (of either kind) was logged
        self._line = (0, 0.0, 0.0)  # (step, time, busy) of the last step line: the next line's means
        self._timed: tuple[int, float] | None = None  # (step, time) the ETA's mean counts from

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, engine: Engine, step: int) -> None:
        if engine.rank != 0:
            return
        interactive = sys.stdout.isatty() if self.interactive is None else self.interactive
        now = time.perf_counter()
        self._last = now
        if interactive and self.bar:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._progress = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn())
            self._task = self._progress.add_task("train", total=self.max_steps, completed=step, status="")
            self._progress.start()
        elif self.log_every > 0:
            self._first = self._step = step
            self._started = self._ended = self._said = now
            self._line, self._timed, self._loss = (step, now, 0.0), None, None
            self._began, self._busy, self._validating = None, 0.0, False
            self._lines = True
            self._stop.clear()
            if Progress._beating is not None:  # a job of this process that failed (a sweep goes on)
                Progress._beating._stop.set()
            Progress._beating = self
            self._thread = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
            self._thread.start()

    def on_step_start(self, engine: Engine, step: int) -> None:
        with self._lock:
            self._began = self._last = time.perf_counter()

    def on_before_optimizer_step(self, engine: Engine, step: int) -> None:
        if self._lines:
            self._lr = learning_rate(engine)

    def on_validation_start(self, engine: Engine, step: int) -> None:
        self._validating = True

    def on_validation_end(self, engine: Engine, step: int, metrics: dict) -> None:
        self._validating = False

    def on_step_end(self, engine: Engine, step: int, loss: float) -> None:
        now = time.perf_counter()
        if self._progress is not None:
            rate = self.tokens_per_step / max(now - self._last, 1e-9)
            self._last = now
            self._progress.update(self._task, completed=step, status=f"loss {loss:.4f}  {rate:,.0f} tok/s")
            return
        if not self._lines:
            return
        with self._lock:
            first = self._timed is None
            # (a step's start to its end; a caller without on_step_start: since the last end)
            self._busy += now - (self._ended if self._began is None else self._began)
            self._step, self._loss, self._ended, self._began = step, float(loss), now, None
            if first:  # the ETA's mean starts after this attempt's first step (its warm-up)
                self._timed = (step, now)
            if first or step % self.log_every == 0 or step >= self.max_steps:
                self._say(self._step_line())

    def on_train_end(self, engine: Engine) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._lines:
            with self._lock:
                self._lines = False
                if self._step > self._line[0]:  # stopped between lines (a signal): where it stopped
                    self._say(self._step_line())
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        if Progress._beating is self:
            Progress._beating = None

    # ------------------------------------------------------------------ lines
    def _mean_step(self) -> float | None:
        """This attempt's mean wall-clock step, validations and checkpoints in (after its first
        step, the warm-up; the first alone while it is the only one); None before it ends."""
        if self._timed is None:
            return None
        step, at = self._timed
        if self._step > step:
            return (self._ended - at) / (self._step - step)
        return (at - self._started) / max(step - self._first, 1)

    def _eta(self) -> float | None:
        """Seconds left: the steps to go times ``_mean_step``."""
        left = self.max_steps - self._step
        if left <= 0:
            return 0.0
        mean = self._mean_step()
        return None if mean is None else left * mean

    def _overdue(self, now: float) -> bool:
        """What runs now (a step, a validation, a checkpoint) has run ``OVERDUE`` times the mean
        step since the last step ended, and at least half a heartbeat: a stall, or a slow phase."""
        mean = self._mean_step()
        return mean is not None and now - self._ended > max(OVERDUE * mean, self.heartbeat / 2)

    def _say(self, line: str, *, step_line: bool = True) -> None:
        """Log ``line`` (the lock held); a step line starts the next one's means."""
        log.info("%s", line)
        self._said = time.perf_counter()
        if step_line:
            self._line = (self._step, self._ended, self._busy)

    def _step_line(self, eta: bool = True) -> str:
        """The line after step ``self._step``: step time and tokens/s are the mean of the steps
        since the step of the line before, each its start to its end (not what ran between);
        ``eta``: with the ETA (not when an overdue step's line follows)."""
        step, _, busy = self._line
        per = (self._busy - busy) / (self._step - step) if self._step > step else 0.0
        parts = [f"step {self._step}/{self.max_steps} ({self._step / max(self.max_steps, 1):.0%})",
                 f"loss {self._loss:.4f}", f"lr {self._lr:.2e}",
                 f"{self.tokens_per_step / per:,.0f} tok/s" if per > 0 else "- tok/s", f"{per:.3f} s/step"]
        if eta and (left := self._eta()) is not None:
            parts.append(f"ETA {_clock(left)}")
        if (mem := memory_now()) is not None:
            parts.append(f"mem {mem}")
        return " | ".join(parts)

    def _running(self) -> str:
        """What runs now, for the heartbeat: a step, a validation, or what runs between steps."""
        done = f"step {self._step}/{self.max_steps}"
        if self._validating:
            return f"validating after {done}"
        if self._began is not None or self._step == self._first:  # (a step, or the first's batch)
            return f"step {self._step + 1}/{self.max_steps} still running"
        if self._step >= self.max_steps:
            return f"after {done}, finishing (a checkpoint, the report)"
        return f"after {done}, between steps (a checkpoint, the next batch)"

    def _beat(self) -> None:
        """Nothing logged for ``heartbeat`` seconds: ``_pulse``, until train end."""
        while not self._stop.wait(min(self.heartbeat, 5.0)):
            with self._lock:
                self._pulse(time.perf_counter())

    def _pulse(self, now: float) -> None:
        """One heartbeat (the lock held): the line of the last step when one ended since the line
        before; then, or else, what is running and for how long (a long step, a validation, a
        checkpoint). When what runs is overdue (``_overdue``) both lines come at this beat, and a
        step that is overdue gets no ETA: the mean it comes from no longer holds."""
        if not self._lines or now - self._said < self.heartbeat:
            return
        overdue = self._overdue(now)
        if self._step > self._line[0]:
            self._say(self._step_line(eta=not overdue))
            if not overdue:
                return
        stalled = overdue and self._began is not None  # (a step; not a validation or a checkpoint)
        since = "training started" if self._step == self._first else f"step {self._step} ended"
        tag = f", overdue ({self._mean_step():.3f} s a step so far)" if stalled else ""
        parts = [f"{self._running()}: {_clock(now - self._ended)} since {since}{tag}"]
        if self._loss is not None:
            parts.append(f"last loss {self._loss:.4f}")
        if not stalled and (eta := self._eta()) is not None:
            parts.append(f"ETA {_clock(eta)}")
        if (mem := memory_now()) is not None:
            parts.append(f"mem {mem}")
        self._say(" | ".join(parts), step_line=False)


@dataclass
class ProgressKnobs:
    progress_bar: bool = True
    """A progress bar on rank 0 when stdout is a terminal: optimizer steps, loss, tokens/s."""
    log_every: int = knob(10, min=0)
    """When stdout is not a terminal (a log file, nohup, Slurm, CI) or there is no bar: one log line
    on rank 0 every this many optimizer steps, and at least every 60 s (step, loss, lr, tokens/s,
    step time, ETA, memory); 0: none."""


@observer("progress", order=20, knobs=ProgressKnobs)
def _selected(s: Selection) -> Observer | None:
    """``callbacks.progress_bar`` or ``callbacks.log_every``: the bar on a terminal, else a line
    every ``log_every`` steps."""
    cb = s.job.callbacks
    if not (cb.progress_bar or cb.log_every):
        return None
    return Progress(s.job.trainer.max_steps, s.job.tokens_per_step, bar=cb.progress_bar,
                    log_every=cb.log_every)
