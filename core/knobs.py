"""Declared checks on config fields: a field says its allowed values where it is defined, and one
function turns every violation into a sentence naming the key, the value, what is allowed and
the fix.

    dim: int = knob(MISSING, min=1)
    precision: str = knob("32", choices=("32", "bf16-mixed", "16-mixed"))
    path: str | None = knob(None, exists="file", fix="point it at a UTF-8 text file, or null")

``problems(obj, "model")`` walks the dataclass fields of ``obj`` and checks each declared rule;
``unchecked(cls)`` lists numeric and string fields that declare neither a rule nor why any value
suits them (``free``); a test keeps it empty, so a new knob cannot skip validation. Torch-free: schemas import this at compose time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Fields that name things rather than set them: nothing to check.
NAMES = frozenset({"name", "family"})

_ELSEWHERE: ContextVar[Callable[[str], bool] | None] = ContextVar("elsewhere", default=None)


@contextmanager
def paths_elsewhere(where: Callable[[str], bool]) -> Iterator[None]:
    """While validating a job that will run on another machine (a SageMaker container): the paths
    ``where`` accepts exist there, not here; their existence is not checked on this machine."""
    token = _ELSEWHERE.set(where)
    try:
        yield
    finally:
        _ELSEWHERE.reset(token)


def elsewhere(path: Any) -> bool:
    """``path`` lives on the machine the job will run on (``paths_elsewhere``)."""
    where = _ELSEWHERE.get()
    return bool(where and path is not None and where(str(path)))


@dataclass(frozen=True)
class Check:
    min: float | None = None
    """value >= min."""
    above: float | None = None
    """value > above."""
    max: float | None = None
    """value <= max."""
    below: float | None = None
    """value < below."""
    choices: tuple[Any, ...] | None = None
    exists: str | None = None
    """file | dir | any: the value is a path that must exist (with ``choices``: or one of them)."""
    fix: str | None = None
    """How to fix it, when the generic advice does not say enough."""
    at_launch: bool = False
    """The path is on the machine the job runs on: checked at launch (train.py), not when a
    job is planned (plan.py), possibly from another machine."""

    def allowed(self) -> str:
        if self.choices is not None:
            listed = ", ".join(str(c) for c in self.choices)
            return listed if self.exists is None else f"{listed}, or an existing {self.exists} path"
        parts = [f">= {_num(self.min)}" if self.min is not None else "",
                 f"> {_num(self.above)}" if self.above is not None else "",
                 f"<= {_num(self.max)}" if self.max is not None else "",
                 f"< {_num(self.below)}" if self.below is not None else ""]
        return " and ".join(p for p in parts if p)

    def violated(self, value: Any) -> str | None:
        """Why ``value`` breaks this rule, or None."""
        if self.choices is not None and (value in self.choices or self.exists is None):
            return None if value in self.choices else f"is not one of {self.allowed()}"
        if self.exists is not None:  # (with choices: a path is the other allowed kind of value)
            if elsewhere(value):
                return None
            path = Path(str(value)).expanduser()
            ok = {"file": path.is_file, "dir": path.is_dir}.get(self.exists, path.exists)()
            kind = {"file": "a file", "dir": "a directory"}.get(self.exists, "a path")
            return None if ok else f"does not exist or is not {kind}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"must be a finite number {self.allowed()}"
        if ((self.min is not None and value < self.min) or (self.above is not None and value <= self.above)
                or (self.max is not None and value > self.max)
                or (self.below is not None and value >= self.below)):
            return f"must be {self.allowed()}"
        return None


def knob(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
         **rule: Any) -> Any:
    """A dataclass field with a declared ``Check`` (see the module docstring)."""
    check = Check(**rule)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"check": check})
    return dataclasses.field(default=default, metadata={"check": check})


def free(default: Any, why: str) -> Any:
    """A field any value of its type suits (a name, a path to create), and why."""
    return dataclasses.field(default=default, metadata={"free": why})


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _advice(key: str, f: dataclasses.Field, check: Check) -> str:
    if check.fix:
        return check.fix
    # (no default named: the schema's is not what a preset, a cluster's implications or an
    # experiment set -- trainer.max_steps is 60 in conf/, cluster.devices 8 on a node preset)
    return f"set {key} to a value {check.allowed()}" if check.choices is None \
        else f"set {key} to one of {check.allowed()}"


def problems(obj: Any, prefix: str, *, launch: bool = True) -> list[str]:
    """Every declared rule that a field of the dataclass instance ``obj`` breaks, as sentences.
    A field whose value is None passes when its default is None or its type allows None
    (optional knobs). ``launch``: also the rules checked only on the machine that runs the job
    (``at_launch``)."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):  # a nested section
            out += problems(value, f"{prefix}.{f.name}", launch=launch)
            continue
        check = f.metadata.get("check")
        if check is None or (check.at_launch and not launch):
            continue
        if value is None and (f.default is None or "None" in str(f.type)):
            continue
        why = check.violated(value)
        if why:
            key = f"{prefix}.{f.name}"
            out.append(f"{key}={value!r} {why}; {_advice(key, f, check)}"
                       if not why.startswith("must") else
                       f"{key}={value!r}: {why}; {_advice(key, f, check)}")
    return out


def unchecked(cls: type) -> list[str]:
    """Numeric and string fields of ``cls`` that declare no check (and are not names)."""
    out = []
    for f in dataclasses.fields(cls):
        if f.name in NAMES or "check" in f.metadata or "free" in f.metadata:
            continue
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            out += [f"{f.name}.{x}" for x in unchecked(f.default_factory)]
            continue
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if not kind.startswith(("dict", "list", "Any")) and any(t in kind for t in ("int", "float", "str")):
            out.append(f.name)
    return out
