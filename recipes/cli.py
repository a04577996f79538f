"""What train.py and plan.py share at the command line: every configuration error, whether Hydra
finds it while composing or validation finds it after, ends the same way -- one message, no
traceback, exit code 2 -- and the README's spelling ``group=null`` switches an opt-in group off
(Hydra's own spelling is ``~group``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from strategies.conf import CONF_DIR

T = TypeVar("T")

CONFIG_ERROR = 2

_started = False


def normalize(argv: list[str]) -> list[str]:
    """``logger=null`` -> ``~logger`` for every config group (a folder of conf/)."""
    out = []
    for arg in argv:
        group, _, value = arg.partition("=")
        if value == "null" and "." not in group and (CONF_DIR / group).is_dir():
            arg = f"~{group}"
        out.append(arg)
    return out


def rank_aware_logging() -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors, prefixed with their rank.
    (Launchers start ranks > 0 with RANK or LOCAL_RANK set.)"""
    rank = int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)
    if rank == 0:
        return
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))


def started() -> None:
    """Called first thing in the task function: composition succeeded."""
    global _started
    _started = True


def fail(error: Exception, log: logging.Logger) -> None:
    """A configuration error found after composition: log it and exit 2."""
    log.error("%s", error)
    sys.exit(CONFIG_ERROR)


def or_exit(step: Callable[[], T]) -> T:
    """Run a composition or validation step outside a Hydra app (plan.py): a configuration
    error is printed as Hydra would print it, without a traceback, and exits 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from strategies.mesh import ConfigError

    try:
        return step()
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        cause = f"\n{e.__cause__}" if isinstance(e.__cause__, OmegaConfBaseException) else ""
        print(f"{e}{cause}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)


def query(argv: list[str], doc: str) -> tuple[object, set[str], list[str]] | None:
    """The start of a script that queries the config instead of running a job (plan.py,
    export.py): ``--help`` prints ``doc`` and the groups (None); otherwise the composed config,
    the groups it chose rather than took by default (``compose_chosen``) and the normalized
    overrides, or the composition error and exit 2."""
    if {"-h", "--help"} & set(argv):
        print(doc + "\n" + groups_help())
        return None
    from recipes.config import compose_chosen

    argv = normalize(argv)
    cfg, chosen = or_exit(lambda: compose_chosen(argv))
    return cfg, chosen, argv


def groups_help() -> str:
    """The config groups and their options, as files of conf/ (what ``--help`` lists)."""
    from dataclasses import fields

    from recipes.config import TrainConfig

    lines = ["config groups (group=option; group=null switches an opt-in group off):"]
    public = {f.name for f in fields(TrainConfig)}
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name in public):
        options = ", ".join(sorted(f.stem for f in group.glob("*.yaml")))
        lines.append(f"  {group.name}: {options}")
    return "\n".join(lines)


def run(main: Callable[[], None]) -> None:
    """Run a ``@hydra.main`` app. Hydra reports a config that fails to compose (an unknown
    option or key, a wrong type) and exits 1; before the task function started, that is a
    configuration error like any other, so it exits 2."""
    sys.argv[1:] = normalize(sys.argv[1:])
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _started:
            sys.exit(CONFIG_ERROR)
        raise
