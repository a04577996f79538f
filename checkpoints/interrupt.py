"""Stopping a run cleanly on a signal: the one owner of resume under Slurm requeue, preemption,
``kill -TERM`` and Ctrl-C.

SIGUSR1 (Slurm's warning ``cluster.slurm.requeue_signal_s`` before the time limit), SIGTERM
(preemption, ``scancel``, an orchestrator's stop) and SIGINT (Ctrl-C) only set a flag: a handler
never saves, never waits on a collective and never raises -- the other ranks may be inside a
collective, and a barrier there deadlocks (what Lightning's own SIGUSR1 handler did,
Lightning#21406); a raised ``KeyboardInterrupt`` is what Lightning catches to end the fit
without a checkpoint ("Detected KeyboardInterrupt, attempting graceful shutdown", exit 1). At
every optimizer-step boundary each backend asks ``requested()``: the ranks agree (one all-reduce
of the signal number, MAX), so a signal delivered to any one rank stops all of them after the
same step; they save the checkpoint together and raise ``Interrupted``, which the launcher turns
into a requeue (Slurm, SIGUSR1) or an exit that names the checkpoint and the command that
resumes from it (launchers/resume.py).

Ctrl-C twice: the second SIGINT ends the process at once, without a checkpoint (exit 130). A
terminal delivers Ctrl-C to its whole foreground process group -- every rank and the process that
started them -- and torchrun's agent passes the SIGINT it got on to its ranks as well, so a rank
may see one press twice within milliseconds: a SIGINT less than ``SAME_PRESS_S`` after the first
is that same press. Our own launcher passes the first press on as SIGTERM instead, which a rank
already stopping ignores (launchers/local.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
HELD = "STRATAGEM_HELD_SIGNAL"
"""A SIGUSR1 a Slurm job's process took before it imported us (launchers/site/sitecustomize.py)."""
SAME_PRESS_S = 1.0
"""A SIGINT this soon after the first is the same Ctrl-C, passed on by a launcher."""


class Interrupted(Exception):
    """The run stopped after a step on a signal; its checkpoint is saved."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"; checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {name} after step {step}{where}")


def say(message: str) -> None:
    """One line on stderr from a signal handler: a raw write (a buffered stream or a logging
    handler may be in the middle of a write of the code the signal interrupted)."""
    try:
        os.write(2, f"{message}\n".encode())
    except OSError:
        pass


def exit_now(code: int) -> None:
    """End this process at once (a second Ctrl-C): what the streams hold is flushed first, when
    they are not in the middle of a write."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001  (a reentrant flush from a signal handler)
            pass
    os._exit(code)


class Interrupt:
    """The signal flag of this process, and the ranks' agreement on it (one per process:
    ``current``)."""

    def __init__(self) -> None:
        self.signum = 0
        self.presses = 0
        """Ctrl-Cs seen (one press forwarded twice counts once)."""
        self.announce = True
        """Say on stderr what a Ctrl-C does (rank 0; our launcher's ranks leave it to the launcher)."""
        self._first = 0.0
        self._pid = 0
        self._before: Any = None
        self.taken: Any = None
        """Called when this process takes its stop signals (our launcher's ranks tell it so)."""

    def install(self) -> Interrupt:
        """Take SIGUSR1, SIGTERM and SIGINT (again: Lightning sets its own as a fit starts; from
        the main thread only). SIGUSR1 and SIGTERM are kept for the rest of the process, so a
        signal that arrives after the last step (Slurm's warning while the report is written)
        cannot kill a run that is done; SIGINT goes back to what it was at ``release``."""
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, self._handler)
            held = signal.getsignal(signal.SIGINT)
            if held != self._sigint:
                self._before = held
                signal.signal(signal.SIGINT, self._sigint)
            self._pid = os.getpid()
            if self.taken is not None:
                self.taken()
        return self

    def release(self) -> None:
        """SIGINT back to its handler before ``install`` (the run is over: a Ctrl-C during what
        follows, an export or a conversion, ends the process as usual)."""
        import threading

        if (self._before is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) == self._sigint):
            signal.signal(signal.SIGINT, self._before)
            self._before = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum  # the first signal names the stop

    def _sigint(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a process forked from this one (a DataLoader worker): ours decides
            return
        now = time.monotonic()
        if self.presses and now - self._first < SAME_PRESS_S:
            return  # the same Ctrl-C, passed on by a launcher
        self.presses += 1
        rank0 = self.announce and int(os.environ.get("RANK", "0")) == 0
        if self.presses == 1:
            self._first = now
            self.signum = self.signum or signum
            if rank0:
                say("Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop at once, "
                    "without one)")
            return
        if rank0:
            say("Ctrl-C again: stopped at once, without a checkpoint of this step")
        exit_now(128 + signal.SIGINT)

    def requested(self, device: Any = None) -> int:
        """The signal every rank agrees to stop on after this step (0: none). Collective when a
        process group of more than one rank exists: every rank must call it at the same step."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


_CURRENT = Interrupt()


def hold() -> None:
    """Take SIGUSR1 now, the first thing a process of ours does (train.py's first import, the
    task function's first line under submitit): Slurm's requeue signal during start-up -- imports,
    validation, the model's build -- is held until the first step boundary, where every rank agrees
    on it, saves and requeues, instead of killing the rank (SIGUSR1's default action) and leaving
    its peers waiting in a collective. SIGTERM keeps ending a rank at once until training starts
    (nothing is saved before the first step). From the main thread only."""
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, _CURRENT._handler)
    held = os.environ.pop(HELD, None)  # (taken before this process imported us: launchers/site/)
    if held:
        _CURRENT._handler(int(held), None)


def current() -> Interrupt:
    """This process's flag."""
    return _CURRENT
