"""What the launcher says when a rank is lost (launchers/local.py): which rank, how it ended, and
the cause where the failures torch's agent records tell it -- a bad record in the data, a
configuration problem found in the ranks or a full disk, said as itself; a peer that stopped
responding, which the rank that waited for it timed out on."""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Callable

from core.errors import ConfigError, DataError

# What a rank's wait says when it timed out: a collective (gloo, NCCL), the store as the process
# group forms (DistStoreError: "wait timeout after 60000ms").
TIMED_OUT = ("timed out", "Timed out", "wait timeout")
# What a rank's collective says when a peer is gone (gloo, NCCL, the store).
PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", *TIMED_OUT,
             "communicator was aborted", "DistNetworkError")
_ERRNO = re.compile(r"\[Errno (\d+)\] (.*)")
"""An OSError's text: ``[Errno 28] No space left on device: ...``."""
ROLL = "STRATAGEM_ROLL"
"""The directory where our launcher's ranks write their pids (``Roll``), in their environment."""


class Roll:
    """Which rank each of this node's processes is: each rank writes its pid under its global rank
    as it starts (``enter``), so the launcher can name a pid that torch's agent only logs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def enter() -> None:
        """In a rank: write this process's pid as its rank's (where the launcher gave a roll)."""
        where = os.environ.get(ROLL)
        if where and "RANK" in os.environ:
            (Path(where) / os.environ["RANK"]).write_text(str(os.getpid()))

    @staticmethod
    def taken() -> None:
        """In a rank: say that it took its stop signals (a stop then saves after its step)."""
        where = os.environ.get(ROLL)
        if where and "RANK" in os.environ:
            (Path(where) / f"{os.environ['RANK']}.stops").touch()

    def all_taken(self, ranks: int) -> bool:
        """Every one of this node's ``ranks`` took its stop signals."""
        return len(list(self.path.glob("*.stops"))) >= ranks

    def ranks(self, pids: set[int]) -> dict[int, int]:
        """Global rank -> pid, for those of ``pids`` a rank wrote."""
        found = {}
        for f in self.path.iterdir() if self.path.is_dir() else ():
            try:
                pid = int(f.read_text())
            except (OSError, ValueError):
                continue
            if pid in pids and f.name.isdigit():
                found[int(f.name)] = pid
        return found


class Reaper(logging.Filter):
    """When a rank fails, torch's agent (torch.multiprocessing's ``ProcessContext.join``) sends the
    others SIGTERM and kills them 30 s later. A rank stuck in a collective or in its own code
    ignores that SIGTERM (its stop handler, checkpoints/interrupt.py, only sets a flag), so a job
    whose rank hung ended 30 s after the collective timeout. On the agent's record of that
    SIGTERM ("Terminating process <pid> via signal SIGTERM", torch.multiprocessing.spawn's log),
    unless the launcher itself is stopping the run (``stopping``), the rank gets ``GRACE_S`` to
    exit (a rank whose peer vanished needs ~2 s: ``_rank``), then is killed; ``killed`` holds the
    pids killed so, or by torch after its grace ("Unable to shutdown process <pid>"); ``ended``
    every pid sent that SIGTERM (a rank stuck before our handlers exist ends on it)."""

    GRACE_S = 5.0

    def __init__(self, stopping: Callable[[], bool]) -> None:
        super().__init__()
        self.stopping = stopping
        self.killed: set[int] = set()
        self.ended: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        if not args or not isinstance(args[0], int):
            return True
        if text.startswith("Terminating process") and not self.stopping():
            self.ended.add(args[0])
            timer = threading.Timer(self.GRACE_S, self._kill, (args[0],))
            timer.daemon = True
            timer.start()
        elif text.startswith("Unable to shutdown process"):
            self.killed.add(args[0])
        return True

    def _kill(self, pid: int) -> None:
        try:  # (still running: not exited; WNOWAIT leaves the exit to the agent, which reaps it)
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                os.kill(pid, signal.SIGKILL)
                self.killed.add(pid)
        except (ChildProcessError, ProcessLookupError):  # (exited and reaped already)
            pass


def _quiet_said_errors(record: logging.LogRecord) -> bool:
    """A filter for torch's agent log: not its record of a rank that failed on an error we say
    in one line (a ``DataError``: a bad record in the data; a ``ConfigError`` found in the ranks:
    a run directory the nodes do not share; a full disk's ``OSError``), with the rank's whole
    traceback: that sentence ends the run (``_said_error``). Other failures are logged as torch
    logs them."""
    error = record.exc_info[1] if record.exc_info else None
    return error is None or _raised(str(error)) is None


def _said(failure: Any) -> str:
    """What a failed rank's error record says (torch's agent), or ""."""
    msg = failure.message if isinstance(failure.message, str) else (failure.message or {}).get("message", "")
    return "" if msg in (None, "<NONE>") else str(msg).strip()


def _raised(text: str) -> DataError | ConfigError | OSError | None:
    """The ``DataError`` or ``ConfigError`` (core/errors.py), or a full disk's ``OSError``
    (``checkpoints.save``'s, ``disk_full``), a rank's error text (torch's record of it, or its
    traceback) ends in, rebuilt; None when it ends in another error."""
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        kind, _, message = lines[i].partition(": ")
        if kind in ("OSError", "builtins.OSError") and (m := _ERRNO.match(message)):
            error = OSError(int(m.group(1)), m.group(2))
            return error if int(m.group(1)) in (errno.ENOSPC, errno.EDQUOT) else None
        if kind in ("DataError", f"{DataError.__module__}.DataError"):
            return DataError("\n".join([message, *lines[i + 1:]]))
        if kind in ("ConfigError", f"{ConfigError.__module__}.ConfigError"):
            problems = [ln.strip()[2:] for ln in lines[i + 1:] if ln.strip().startswith("- ")]
            return ConfigError(problems or message)
        if not lines[i].startswith(" "):  # (an exception's first line: not ours)
            return None
    return None


def _said_error(e: Any) -> DataError | ConfigError | OSError | None:
    """The ``DataError``, ``ConfigError`` or full disk's ``OSError`` the failed ranks raised, when
    that is every failure's cause (the ranks the agent then stopped with SIGTERM aside, and those
    whose peers vanished with it): a bad record in the data, a run directory the nodes do not
    share, a checkpoint that did not fit -- the same sentence from each rank that found it."""
    said = {}
    for f in e.failures.values():
        if f.exitcode == -signal.SIGTERM:
            continue
        error = _raised(_said(f)) if f.exitcode > 0 else None
        if error is None and not (f.exitcode > 0 and any(p in _said(f) for p in PEER_GONE)):
            return None
        if error is not None:
            said[(type(error), str(error))] = error
    return next(iter(said.values())) if len(said) == 1 else None


MISMATCH = "collective mismatch"
"""gloo's words when the ranks' collectives differ ("Is there a distributed collective mismatch")."""


def mismatch_hint(e: Any) -> str:
    """Under a ZeRO preset: a rank ended by SIGABRT or with gloo's collective-mismatch text is most
    likely a parameter used on some ranks and not on others in one step, which DeepSpeed's
    reductions in backward cannot take (the SkippedParameterError check at the step comes too late)."""
    ended = [f for f in e.failures.values() if f.exitcode == -signal.SIGABRT or MISMATCH in _said(f)]
    if not ended:
        return ""
    return ("; under ZeRO this is most likely a parameter that got a gradient on some ranks and none "
            "on others in one step (a data-dependent branch, an expert no token reached): DeepSpeed's "
            "reductions then differ between ranks (gloo aborts: 'Is there a distributed collective "
            "mismatch', deepspeedai/DeepSpeed#1355). Fix: make every rank use every parameter in each "
            "forward (add 0 * the skipped layer's output), or use fsdp2 or a ddp preset")


def _lost(e: Any, world: int, nodes: int = 1, stuck: dict[int, int] | None = None,
          ended: dict[int, int] | None = None) -> str:
    """Which rank was lost and how, from the agent's failures (the ranks the agent itself then
    stopped end by SIGTERM and are not the cause). On one node of several, when every failure
    here is a peer gone, the lost rank is on another node: say that, not this node's own. A rank
    that timed out waiting is not the cause: the ranks that had to be killed (``stuck``: global
    rank -> pid, ``Reaper``) are, when known."""

    if nodes > 1:
        mine = sorted(e.failures.items())
        if mine and all(f.exitcode > 0 and any(p in _said(f) for p in PEER_GONE) for _, f in mine):
            first = _said(mine[0][1]).splitlines()[-1][:300]
            return (f"a rank on another node was lost: this node's ranks {[r for r, _ in mine]} of "
                    f"{world} stopped when their peers vanished ({first}); the other node's log "
                    "names the lost rank")

    def how(code: int) -> str:
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    # global rank -> failure (torch records the first it finds; see _rank). A signal the agent
    # did not send (it stops the rest with SIGTERM) first, then errors, then the rest.
    def kind(code: int) -> int:
        return 0 if code < 0 and code != -signal.SIGTERM else 1 if code > 0 else 2

    failures = sorted(e.failures.items(), key=lambda rf: (kind(rf[1].exitcode), rf[1].timestamp))
    rank, first = failures[0]
    detail = ""
    if first.exitcode > 0 and _said(first):
        detail = f": {_said(first).splitlines()[-1][:500]}"
    others = sorted({r for r, _ in failures} - {rank})
    if first.exitcode > 0 and any(t in detail for t in TIMED_OUT):  # (a peer, not it)
        where = "as the process group formed" if "DistStoreError" in detail else "in a collective"
        who = "another rank"
        if stuck:
            names = ", ".join(f"{r} (pid {pid})" for r, pid in sorted(stuck.items()))
            who = f"rank{'s' if len(stuck) > 1 else ''} {names}, killed then,"
        elif ended and len(ended) == 1:
            [(r, pid)] = ended.items()
            who = f"rank {r} (pid {pid}), ended by the launcher then,"
        elif ended:
            who = f"one of ranks {sorted(ended)} (ended by the launcher then)"
        return (f"rank {rank} of {world} timed out waiting for its peers {where}{detail}: {who} "
                "stopped responding (hung, stopped, or slower than cluster.collective_timeout); "
                "the job stopped")
    return (f"lost rank {rank} of {world} (pid {first.pid}) -- it {how(first.exitcode)}{detail}; "
            "the job stopped" + (f" (ranks {others} were stopped with it)" if others else ""))
