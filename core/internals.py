"""Asking the running torch for a private name we lean on (docs/ARCHITECTURE.md, "Where we lean on
torch's internals"), instead of letting a renamed one fail as a bare AttributeError deep in a rank
or, worse, give a silently wrong number.

``lacking`` names what an object lacks; ``lacks_message`` says it in one sentence (the feature, the
names, the running torch's version, the fix); ``require`` raises it (``TorchLacks``, or the error
the caller's feature raises, such as ``CheckpointError``); ``warn_once`` logs a feature that degrades
instead, once per process. The probes take the object they ask, so a test hands them a stand-in.
Torch-free at import: the version is read from torch only when a message is written.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

PROVEN = "2.11 to 2.13"
"""The torch versions CI runs (.ci/run's two legs): the fix a message names."""

_WARNED: set[str] = set()


class TorchLacks(RuntimeError):
    """A feature needs a private torch name the running torch does not have."""


def lacking(owner: Any, names: Iterable[str]) -> list[str]:
    """The ``names`` ``owner`` has no attribute for (None lacks them all)."""
    return [n for n in names if owner is None or not hasattr(owner, n)]


def torch_version() -> str:
    try:
        import torch
    except ImportError:  # (a message about torch with no torch: say so)
        return "(not installed)"
    return str(torch.__version__)


def lacks_message(feature: str, where: str, missing: Iterable[str], fix: str) -> str:
    """One sentence: ``feature`` needs ``where.<name>`` for each missing name, which this torch
    does not have, and ``fix``."""
    names = ", ".join(f"{where}.{n}" for n in missing)
    return f"{feature} needs {names}, which torch {torch_version()} does not have; {fix}"


def require(owner: Any, names: Iterable[str], *, feature: str, where: str, fix: str,
            error: type[Exception] = TorchLacks) -> Any:
    """``owner`` when it has every name, else ``error`` with ``lacks_message``."""
    missing = lacking(owner, names)
    if missing:
        raise error(lacks_message(feature, where, missing, fix))
    return owner


def warn_once(log: logging.Logger, key: str, message: str) -> bool:
    """Log ``message`` as a warning the first time ``key`` is seen in this process; whether it was."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    log.warning(message)
    return True
