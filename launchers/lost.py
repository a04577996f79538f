"""What the launcher says when a rank is lost (launchers/local.py): which rank, how it ended, and
the cause where the failures torch's agent records tell it -- a bad record in the data or a
configuration problem found in the ranks, said as itself; a peer that stopped responding, which
the rank that waited for it timed out on."""

from __future__ import annotations

import logging
import signal
from typing import Any

from core.errors import ConfigError, DataError

# What a rank's collective says when a peer is gone (gloo, NCCL, the store).
PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "timed out", "Timed out",
             "communicator was aborted", "DistNetworkError")


def _quiet_said_errors(record: logging.LogRecord) -> bool:
    """A filter for torch's agent log: not its record of a rank that failed on an error we say
    in one line (a ``DataError``: a bad record in the data; a ``ConfigError`` found in the ranks:
    a run directory the nodes do not share), with the rank's whole traceback: that sentence ends
    the run (``_said_error``). Other failures are logged as torch logs them."""
    error = record.exc_info[1] if record.exc_info else None
    return error is None or _raised(str(error)) is None


def _said(failure: Any) -> str:
    """What a failed rank's error record says (torch's agent), or ""."""
    msg = failure.message if isinstance(failure.message, str) else (failure.message or {}).get("message", "")
    return "" if msg in (None, "<NONE>") else str(msg).strip()


def _raised(text: str) -> DataError | ConfigError | None:
    """The ``DataError`` or ``ConfigError`` (core/errors.py) a rank's error text (torch's record
    of it, or its traceback) ends in, rebuilt; None when it ends in another error."""
    lines = text.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        kind, _, message = lines[i].partition(": ")
        if kind in ("DataError", f"{DataError.__module__}.DataError"):
            return DataError("\n".join([message, *lines[i + 1:]]))
        if kind in ("ConfigError", f"{ConfigError.__module__}.ConfigError"):
            problems = [ln.strip()[2:] for ln in lines[i + 1:] if ln.strip().startswith("- ")]
            return ConfigError(problems or message)
        if not lines[i].startswith(" "):  # (an exception's first line: not ours)
            return None
    return None


def _said_error(e: Any) -> DataError | ConfigError | None:
    """The ``DataError`` or ``ConfigError`` the failed ranks raised, when that is every failure's
    cause (the ranks the agent then stopped with SIGTERM aside, and those whose peers vanished
    with it): a bad record in the data, a run directory the nodes do not share -- the same
    sentence from each rank that found it."""
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


def _lost(e: Any, world: int, nodes: int = 1) -> str:
    """Which rank was lost and how, from the agent's failures (the ranks the agent itself then
    stopped end by SIGTERM and are not the cause). On one node of several, when every failure
    here is a peer gone, the lost rank is on another node: say that, not this node's own."""

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
    if first.exitcode > 0 and any(t in detail for t in ("timed out", "Timed out")):  # (a peer, not it)
        return (f"rank {rank} of {world} timed out waiting for its peers in a collective{detail}: "
                "another rank stopped responding (hung, stopped, or slower than "
                "cluster.collective_timeout); the job stopped")
    return (f"lost rank {rank} of {world} (pid {first.pid}) -- it {how(first.exitcode)}{detail}; "
            "the job stopped" + (f" (ranks {others} were stopped with it)" if others else ""))
