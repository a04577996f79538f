"""Stopping a run cleanly on a signal: the one owner of resume under Slurm requeue, preemption
and ``kill -TERM``.

SIGUSR1 (Slurm's warning ``cluster.slurm.requeue_signal_s`` before the time limit) and SIGTERM
(preemption, ``scancel``, an orchestrator's stop) only set a flag: a handler never saves, never
waits on a collective and never raises -- the other ranks may be inside a collective, and a
barrier there deadlocks (what Lightning's own SIGUSR1 handler did, Lightning#21406). At every
optimizer-step boundary each backend asks ``requested()``: the ranks agree (one all-reduce of
the signal number, MAX), so a signal delivered to any one rank stops all of them after the same
step; they save the checkpoint together and raise ``Interrupted``, which the launcher turns into
a requeue (Slurm, SIGUSR1) or an exit that names the checkpoint. The requeued or restarted job
resumes through ``trainer.resume_from=auto``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Interrupted(Exception):
    """The run stopped after a step on a signal; its checkpoint is saved."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"; checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {name} after step {step}{where}")


class Interrupt:
    """The signal flag of this process, and the ranks' agreement on it (one per process:
    ``current``)."""

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> Interrupt:
        """Take SIGUSR1 and SIGTERM (again: Lightning sets its own as a fit starts; from the main
        thread only). Kept for the rest of the process, so a signal that arrives after the last
        step (Slurm's warning while the report is written) cannot kill a run that is done."""
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum  # the first signal names the stop

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


def current() -> Interrupt:
    """This process's flag."""
    return _CURRENT
