"""A data set's tokenization as the console sees it: who tokenizes, who waits, how far it got.

Every rank may call ``recipes.tokens.token_file`` at once, and an exclusive ``flock`` on the cache
entry's lock lets the first one tokenize while the others wait. Any rank may win, and only rank 0
logs at INFO (``recipes.cli.rank_aware_logging``), so the rank that tokenizes writes where it is
to ``<key>.progress`` beside the lock -- its rank, pid and host, when it began, the stage (reading
the inputs into Arrow, then tokenizing) and the documents done of the total -- at each stage and
at most every ``PROGRESS_S`` between, and removes it once the cache is complete. Then:

- ``take`` (the lock): a rank that finds the lock taken while there is no cache says
  "waiting for rank k to tokenize <path>", naming the holder from its progress file; the rank
  that builds says "tokenizing <path> on rank k" (``Turn.start``);
- while it runs, the start-up watcher (``backends/common/extensions.py``, on every rank, every
  ``EVERY_S``) logs ``Turn.still`` for each ``underway`` turn of its process: the tokenizing
  rank's progress as its file says, so a rank 0 that waits reports a rank 1 that tokenizes;
- the cache's meta records who built it, when and in how long (``Turn.record``), so a rank that
  waited ends with "tokenized on rank k", and "cached" is said only of a cache from before the
  run (``recipes.tokens.TokenFile.origin``, recipes/data.py's data line).

Standard library only (the watcher reads it from its thread).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

PROGRESS_S = 1.0
"""How often the tokenizing rank rewrites its progress file (and at each stage)."""
HOLDER_S = 1.0
"""How long a rank that finds the lock taken looks for the holder's progress file to name it."""

_UNDERWAY: list[Turn] = []


def this_rank() -> int:
    """This process's rank in the job, from the launcher's environment (0 without one)."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _alive(holder: dict[str, Any]) -> bool:
    """The process a progress file names still runs (always True for one on another host)."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError, TypeError):
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Turn:
    """One ``token_file`` call of this process on one cache entry that did not exist: waiting for
    the lock, then (``start``) tokenizing, or reading what the holder built."""

    source: str
    """The input as the config names it (``data.path``)."""
    progress: Path
    """``<key>.progress`` beside the cache entry."""
    rank: int
    began: float = field(default_factory=time.time)
    """When this turn began (seconds since the epoch): its wait, then its build."""
    waiting: bool = True
    _state: dict[str, Any] = field(default_factory=dict)
    _written: float = 0.0

    # ------------------------------------------------------------------ the tokenizing rank
    def start(self, *, files: int, size: int) -> None:
        """This rank has the lock and tokenizes: say so, and write the progress file."""
        self.waiting = False
        now = time.time()
        self._state = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "began": now,
                       "stage": "reading", "stage_began": now, "files": files, "bytes": size,
                       "docs": 0, "total": None}
        self._write()
        log.info("tokenizing %s on rank %d: reading %s into Arrow first (start-up phase data; later "
                 "runs read the cache)", self.source, self.rank, self._inputs(self._state))

    def update(self, *, docs: int | None = None, total: int | None = None, force: bool = False) -> None:
        """``total``: the records are read and tokenizing begins; ``docs``: documents done. The
        file is rewritten at a stage change, and otherwise at most every ``PROGRESS_S``."""
        if total is not None:
            self._state.update(stage="tokenizing", stage_began=time.time(), total=total)
            force = True
        if docs is not None:
            self._state["docs"] = docs
        if force or time.monotonic() - self._written >= PROGRESS_S:
            self._write()

    def record(self) -> dict[str, Any]:
        """What the cache's meta keeps of its build (``built``): who, when, how long."""
        now = time.time()
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "at": now,
                "seconds": round(now - self._state.get("began", self.began), 3)}

    def done(self) -> None:
        """The build ended (complete or not): no progress file left behind."""
        if not self.waiting:
            self.progress.unlink(missing_ok=True)

    def _write(self) -> None:
        tmp = self.progress.with_suffix(f".progress.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self._state))
        os.replace(tmp, self.progress)
        self._written = time.monotonic()

    # ------------------------------------------------------------------ what any rank reads
    def holder(self) -> dict[str, Any] | None:
        """The tokenizing rank's progress: this rank's own, or the holder's file (None: none)."""
        if not self.waiting:
            return dict(self._state)
        try:
            holder = json.loads(self.progress.read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) and _alive(holder) else None

    @staticmethod
    def _inputs(state: dict[str, Any]) -> str:
        files = state.get("files", 0)
        return f"{files} file{'s' if files != 1 else ''} ({_size(state.get('bytes', 0))})"

    def still(self) -> str:
        """The periodic line: how far the tokenizing rank got and for how long (the watcher's)."""
        now = time.time()
        waited = f"; waiting {now - self.began:.0f} s" if self.waiting else ""
        p = self.holder()
        if p is None:
            return (f"still waiting for another process to tokenize {self.source} ({now - self.began:.0f} s): "
                    f"it holds the cache's lock, and no progress file {self.progress} names it")
        head = f"still tokenizing {self.source} on rank {p.get('rank', '?')}: "
        so_far = f"{now - float(p.get('began', now)):.0f} s so far"
        total, docs = p.get("total"), int(p.get("docs") or 0)
        if p.get("stage") != "tokenizing" or not total:
            return f"{head}reading {self._inputs(p)} into Arrow, {so_far}{waited}"
        left = ""
        if docs:
            rate = docs / max(now - float(p.get("stage_began", now)), 1e-9)
            left = f", about {(total - docs) / rate:.0f} s left"
        return f"{head}{docs:,} of {total:,} documents ({100 * docs / total:.0f}%), {so_far}{left}{waited}"

    def waiting_line(self) -> str:
        """What a rank that finds the lock taken says (``take``)."""
        p = self.holder()
        who = (f"rank {p.get('rank', '?')} (pid {p.get('pid', '?')} on {p.get('host', '?')})" if p
               else "another process")
        return (f"waiting for {who} to tokenize {self.source}: it holds the cache's lock "
                f"{self.progress.with_suffix('.lock')}; this rank reads the cache when it is complete")


def take(lock: IO[str], turn: Turn, meta: Path) -> float:
    """Take the cache entry's lock (``flock`` on ``lock``) for ``turn``, saying who tokenizes when
    another process has it and ``meta`` (the complete cache) is not there yet; the seconds waited."""
    import fcntl

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return 0.0
    except BlockingIOError:
        pass
    t0 = time.monotonic()
    # (the holder writes its progress file as it takes the lock: it may be writing it now)
    while turn.holder() is None and not meta.is_file() and time.monotonic() - t0 < HOLDER_S:
        time.sleep(0.05)
    if not meta.is_file():  # (else a rank that only reads the cache holds the lock, for a moment)
        log.info("%s", turn.waiting_line())
    fcntl.flock(lock, fcntl.LOCK_EX)
    return time.monotonic() - t0


@contextlib.contextmanager
def registered(turn: Turn) -> Iterator[Turn]:
    """``turn`` is one of this process's ``underway()`` while the block runs."""
    _UNDERWAY.append(turn)
    try:
        yield turn
    finally:
        _UNDERWAY.remove(turn)


def underway() -> list[Turn]:
    """This process's turns waiting or tokenizing now (the start-up watcher's)."""
    return list(_UNDERWAY)
