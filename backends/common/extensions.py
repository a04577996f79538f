"""C++ extensions that torch builds at first use (DeepSpeed's ops: its CPU shared-memory collective on
every CPU run, cpu_adam, async_io, ...): a watcher that says what a rank is doing while it builds
one or waits for one.

torch.utils.cpp_extension builds extension ``N`` in ``<root>/N/`` (root: ``TORCH_EXTENSIONS_DIR``,
else torch's cache, ``~/.cache/torch_extensions/py311_cpu``) under a lock, ``<root>/N/lock``: a
file created exclusively whose descriptor the builder keeps open and removes when done (torch's
``FileBaton``). Every load takes it, built or not (ninja then finds nothing to do); a process that
finds it waits until the file is gone -- silently, and forever when a killed build left it behind.
A first build is a C++ compile of a minute or more (DeepSpeed's CPU collective: 104 s on 2 cores).

``watch()`` (``backends.run``: every rank, around its build and fit) runs a daemon thread that
samples this process's Python stacks every ``POLL_S`` seconds -- torch's own functions on them say
what is going on; nothing of torch is replaced -- and:

- a build (``_write_ninja_file_and_build_library`` on a stack) that is a first one (no library in
  its folder yet) or lasts ``FIRST_S`` is announced, then reported every ``EVERY_S``; its time is
  the ``op_build`` phase of report.json's ``startup`` (``observers/startup.py``), not the phase
  around it;
- a wait on a lock (``FileBaton.wait``) is explained after ``FIRST_S`` and every ``EVERY_S``: the
  lock's path and age, who on this machine holds it (a process with the file open) or builds in
  its folder (a compiler working there), when the folder last changed, and what to do. A lock
  nobody holds is a warning on every rank; a build another process is running is said at INFO.
  Waiting counts as ``op_build`` too; a wait for another process's first build of the op says
  so (the rank on the console may be the one that waits).

The same thread reports a data set's tokenization (``recipes/token_progress.py``: ``token_file``
says who tokenizes or waits, whichever rank won the cache's lock): every ``EVERY_S`` while this
process waits for it or runs it, ``still tokenizing <path> on rank k: <done> of <total> documents
(..), <s> so far``, from the progress file the tokenizing rank writes. Its time is the ``data``
phase, which the backends time around the data's build, so nothing is ``record``ed for it here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)

POLL_S = 0.5
FIRST_S = 5.0
EVERY_S = 60.0
PHASE = "op_build"


@dataclass(frozen=True)
class Activity:
    """What one thread of this process is doing with an extension: ``build`` or ``wait``."""

    kind: str
    folder: Path
    """The extension's build folder (``<root>/<name>``)."""
    op: str
    """The extension's name (DeepSpeed's op name when DeepSpeed loads it)."""
    deepspeed: bool

    @property
    def lock(self) -> Path:
        return self.folder / "lock"

    @property
    def what(self) -> str:
        return f"DeepSpeed's {self.op} op" if self.deepspeed else f"the C++ extension {self.op}"


def _in(frame: FrameType, *parts: str) -> bool:
    return frame.f_code.co_filename.endswith(os.path.join(*parts))


def activities(frames: dict[int, FrameType] | None = None) -> list[Activity]:
    """What this process's threads (``sys._current_frames()``) are doing with extensions: building
    one (torch's ``_write_ninja_file_and_build_library`` on the stack) or waiting for another
    process's lock on one (torch's ``FileBaton.wait``), named as DeepSpeed's op when DeepSpeed's
    ``OpBuilder.jit_load`` asked for it. Only those frames' locals are read."""
    out = []
    for frame in (sys._current_frames() if frames is None else frames).values():
        kind = folder = name = None
        op, deepspeed = None, False
        f: FrameType | None = frame
        while f is not None:
            code = f.f_code.co_name
            if kind is None and code == "wait" and _in(f, "torch", "utils", "file_baton.py"):
                lock = Path(str(f.f_locals["self"].lock_file_path))
                kind, folder, name = "wait", lock.parent, lock.parent.name
            elif (kind is None and code == "_write_ninja_file_and_build_library"
                  and _in(f, "torch", "utils", "cpp_extension.py")):
                where = f.f_locals
                kind, folder, name = "build", Path(str(where["build_directory"])), str(where["name"])
            elif kind is not None and code == "jit_load" and _in(f, "op_builder", "builder.py"):
                op, deepspeed = str(getattr(f.f_locals.get("self"), "NAME", name)), True
            f = f.f_back
        if kind is not None:
            out.append(Activity(kind, Path(os.path.realpath(folder)), op or name, deepspeed))
    return out


@dataclass(frozen=True)
class Process:
    pid: int
    command: str

    def __str__(self) -> str:
        return f"{self.pid} ({self.command})"


def _command(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = " ".join(p.decode(errors="replace") for p in raw.split(b"\0") if p)
    return text if len(text) <= 100 else text[:97] + "..."


def users(lock: Path, proc: Path = Path("/proc")) -> tuple[list[Process], list[Process]]:
    """(holders, builders) of ``lock`` on this machine: the processes with the lock file open (a
    builder keeps it open until it is done), and those working in its folder (ninja and the
    compiler run there). Processes this user may not inspect are not seen."""
    folder, target = str(lock.parent), str(lock)
    holders, builders = [], []
    try:
        pids = [int(e.name) for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return [], []
    for pid in pids:
        try:
            cwd = os.readlink(proc / str(pid) / "cwd")
            if cwd == folder or cwd.startswith(folder + os.sep):
                builders.append(Process(pid, _command(pid)))
        except OSError:
            pass
        try:
            fds = os.listdir(proc / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(proc / str(pid) / "fd" / fd) == target:
                    holders.append(Process(pid, _command(pid)))
                    break
            except OSError:
                continue
    return holders, builders


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def explain_wait(act: Activity, waited: float, now: float | None = None,
                 first: bool = False) -> tuple[int, str]:
    """(log level, sentence) for a wait of ``waited`` seconds on ``act``'s lock (``now``: epoch);
    ``first``: no library in its folder when the wait began, so the build held is the op's first."""
    now = time.time() if now is None else now
    lock = act.lock
    try:
        age = f"{_ago(now - lock.stat().st_mtime)} old"
    except OSError:
        age = "gone now"
    head = f"waiting {waited:.0f} s for {act.what}: torch's build lock {lock} ({age})"
    holders, builders = users(lock)
    holders = [p for p in holders if p.pid != os.getpid()]
    if holders or builders:
        who = "; ".join([f"process {p} holds it" for p in holders]
                        + [f"process {p} works in {act.folder}" for p in builders])
        if first:  # (the rank that lost the race for a first build: often rank 0, the one on the console)
            return logging.INFO, (
                f"waiting {waited:.0f} s for {act.what}, which another process is building for the first "
                f"time (first run only, later runs load it; a C++ compile of a minute or more, start-up "
                f"phase {PHASE}): torch's build lock {lock} ({age}): {who}. This run goes on when it ends.")
        return logging.INFO, (f"{head}: {who}. This run goes on when that build ends (a first build "
                              "takes minutes).")
    try:
        files = [p for p in act.folder.iterdir() if p.name != "lock"]
        latest = max(p.stat().st_mtime for p in files) if files else None
    except OSError:
        latest = None
    changed = (f"its folder last changed {_ago(now - latest)} ago" if latest is not None
               else "its folder holds nothing else")
    return logging.WARNING, (
        f"{head}: no process on this machine holds it or builds in {act.folder}, and {changed} -- "
        f"a killed build left it behind, and torch waits for it forever. If no other machine "
        f"sharing that folder is building {act.op}, delete it and run again: rm {lock}")


def _built(folder: Path) -> bool:
    """A library from an earlier build is in the folder."""
    try:
        return any(p.suffix in (".so", ".pyd", ".dll") for p in folder.iterdir())
    except OSError:
        return False


@dataclass
class _Seen:
    act: Activity
    since: float
    """time.monotonic() when first seen"""
    clock: float
    """the same moment on the start-up timeline's clock"""
    first: bool
    """a first build: no library in the folder when it began"""
    said: float = 0.0
    """time.monotonic() of the last report, 0: none yet"""


class Watcher:
    """The thread (``watch``); ``poll`` is one look, callable on its own (tests)."""

    def __init__(self, first_s: float = FIRST_S, every_s: float = EVERY_S, poll_s: float = POLL_S):
        self.first_s, self.every_s, self.poll_s = first_s, every_s, poll_s
        self._seen: dict[tuple[str, Path], _Seen] = {}
        self._told: dict[tuple[Path, float], float] = {}
        """a tokenization underway -> time.monotonic() of its last line (or of its first sight)"""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watcher:
        self._thread = threading.Thread(target=self._run, name="start-up-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll(frames={})

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.poll_s):
            try:
                self.poll({k: v for k, v in sys._current_frames().items() if k != me})
            except Exception:  # a report must never take the run down
                log.debug("extension watcher", exc_info=True)

    def poll(self, frames: dict[int, FrameType] | None = None) -> None:
        """One look at ``frames`` (default: every thread's)."""
        from observers import startup

        now, clock = time.monotonic(), startup.now()
        current = {(a.kind, a.folder): a for a in activities(frames)}
        for key, act in current.items():
            seen = self._seen.get(key)
            if seen is None:
                seen = self._seen[key] = _Seen(act, now, clock, first=not _built(act.folder))
            lasted = now - seen.since
            due = not seen.said or now - seen.said >= self.every_s
            if act.kind == "build":
                if not seen.said and (seen.first or lasted >= self.first_s):
                    log.info("building %s in %s: first run only, later runs load it (a C++ compile "
                             "of a minute or more, start-up phase %s)", act.what, act.folder, PHASE)
                    seen.said = now
                elif seen.said and due:
                    log.info("still building %s (%.0f s so far)", act.what, lasted)
                    seen.said = now
            elif lasted >= self.first_s and due:
                level, text = explain_wait(act, lasted, first=seen.first)
                log.log(level, "%s", text)
                seen.said = now
        for key in [k for k in self._seen if k not in current]:
            seen = self._seen.pop(key)
            startup.record(PHASE, seen.clock, clock)
            if seen.said:
                if seen.act.kind == "build":
                    log.info("built %s in %.0f s", seen.act.what, now - seen.since)
                else:
                    log.info("%s: the lock is gone after a %.0f s wait", seen.act.what, now - seen.since)
        self._tokenizing(now)

    def _tokenizing(self, now: float) -> None:
        """A line every ``every_s`` for each tokenization this process waits for or runs (none
        when the data's module was never imported)."""
        progress = sys.modules.get("recipes.token_progress")
        turns = {(t.progress, t.began): t for t in progress.underway()} if progress is not None else {}
        for key, turn in turns.items():
            last = self._told.setdefault(key, now)
            if now - last >= self.every_s:
                log.info("%s", turn.still())
                self._told[key] = now
        for key in [k for k in self._told if k not in turns]:
            del self._told[key]


@contextlib.contextmanager
def watch(**kwargs: float) -> Iterator[Watcher]:
    """The watcher's thread while the block runs."""
    watcher = Watcher(**kwargs).start()
    try:
        yield watcher
    finally:
        watcher.stop()
