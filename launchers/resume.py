"""The command that resumes a stopped run (Ctrl-C, SIGTERM): the command line that started it,
with the run directory pinned and ``trainer.resume_from=auto``.

A run directory is named by the clock unless set (conf/hydra/default.yaml), so "the same command
again" would start a fresh run in a new directory: the command names the run directory
(``hydra.run.dir``, absolute: pasted in another directory it names the same run), where
``auto`` finds the checkpoint just saved -- and the newest one again after a second stop, so the
printed command stays right. The logger's record (metrics.csv, the W&B run id) continues in that
directory too.

Under an outside launcher (torchrun, ``accelerate launch``) the command line is the launcher's,
read from the parent process; in a sweep it is this job's overrides as a single run, and
``sweep_command`` the sweep's own command line, which finishes the sweep.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

PINNED = ("hydra.run.dir", "trainer.resume_from")
SWEEP_FLAGS = ("-m", "--multirun")
VALUED_FLAGS = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir")


def command(out: str | Path, resume_from: str | None = "auto") -> str:
    """The command line that resumes the run in ``out`` from its newest complete checkpoint.
    ``resume_from``: what the stopped run had (``auto`` needs no override unless the command
    line set another value)."""
    head, script, args = _command_line()
    sweep = any(a in SWEEP_FLAGS for a in args)
    if sweep:
        args = _flags(args) + _task_overrides()
    kept = [a for a in args if _key(a) not in PINNED]
    extra = [f"hydra.run.dir={_shown(out)}"]
    if resume_from != "auto" or any(_key(a) == "trainer.resume_from" for a in args):
        extra.append("trainer.resume_from=auto")
    return shlex.join([*head, script, *kept, *extra])


def sweep_command(sweep: str | Path) -> str:
    """The command line that finishes a stopped local sweep: the same ``-m`` command with its
    sweep directory pinned (``hydra.sweep.dir``, absolute), where each job's ``resume_from``
    finds what it saved (the stopped job resumes, the jobs after it start; launchers/sweep_dir.py
    lets the same overrides continue in their directories)."""
    head, script, args = _command_line()
    kept = [a for a in args if _key(a) != "hydra.sweep.dir"]
    return shlex.join([*head, script, *kept, f"hydra.sweep.dir={_shown(sweep)}"])


def _key(arg: str) -> str | None:
    """The config key an override sets (``+``/``++``/``~`` stripped); None for a flag."""
    if arg.startswith("-"):
        return None
    return arg.lstrip("+~").partition("=")[0]


def _flags(args: list[str]) -> list[str]:
    """The Hydra flags of a command line (a config name or path, with its value), not its
    overrides and not ``-m``."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a in VALUED_FLAGS and i + 1 < len(args):
            out += [a, args[i + 1]]
            i += 1
        elif a.startswith("-") and a not in SWEEP_FLAGS:
            out.append(a)
        i += 1
    return out


def _command_line() -> tuple[list[str], str, list[str]]:
    """(what runs the script, the script, its arguments as typed)."""
    script, args = sys.argv[0], _as_typed(sys.argv[1:])
    launcher = _launcher_argv(script)
    if launcher is not None:
        return launcher
    return [_python()], script, args


def _as_typed(args: list[str]) -> list[str]:
    """``recipes.cli.normalize`` undone: ``~group`` back to ``group=null`` (what the README says)."""
    from core.conf import CONF_DIR

    return [f"{a[1:]}=null" if a.startswith("~") and "=" not in a and (CONF_DIR / a[1:]).is_dir() else a
            for a in args]


def _python() -> str:
    """``python`` when that is this interpreter on PATH, else the interpreter's path."""
    for name in ("python", "python3"):
        found = shutil.which(name)
        if found and os.path.abspath(found) == os.path.abspath(sys.executable):
            return name
    return sys.executable


def _launcher_argv(script: str) -> tuple[list[str], str, list[str]] | None:
    """Under torchrun or ``accelerate launch`` (this process is a rank it started): the
    launcher's own command line, from its /proc entry, when it names this script."""
    from launchers.local import launched

    if not launched():
        return None
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    names = {script, os.path.abspath(script)}
    at = next((i for i, a in enumerate(argv) if a in names or os.path.abspath(a) in names), None)
    if at is None or at == 0:
        return None
    head = argv[:at]
    if len(head) > 1 and os.path.basename(head[0]).startswith("python") and not head[1].startswith("-"):
        found = shutil.which(os.path.basename(head[1]))  # a launcher script: torchrun, accelerate
        if found and os.path.abspath(found) == os.path.abspath(head[1]):
            head = [os.path.basename(head[1]), *head[2:]]
    return head, argv[at], _as_typed(argv[at + 1:])


def _task_overrides() -> list[str]:
    """This job's own overrides in a sweep (Hydra's record of them)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001  (no Hydra app here)
        return []


def _shown(path: str | Path) -> str:
    """``path`` absolute, as given (not through symlinks): the command is pasted from anywhere,
    and a relative run directory pasted from another directory would name another, where
    ``auto`` finds nothing and a fresh run starts silently."""
    return os.path.abspath(path)
