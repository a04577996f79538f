"""Where a composed config came from, as Hydra recorded it (``Origin``): the option each group was
composed from (``hydra.runtime.choices``: ``strategy: my_fsdp`` where the preset's ``name`` is its
parent's ``fsdp2``), the user's own config directories in the order Hydra searched them, the top
config's name and the job's overrides. train.py reads it off its running app (``HydraConfig``);
every other composition -- plan.py, export.py, launch.py, ``--dry-run``, a sweep's preflight --
off its own compose's Hydra node (``recipes.compose.compose_chosen``); validation takes it
(``recipes.job.validate(origin=...)``): ``problems`` and ``warnings``, a user's file a built-in
option hides, and the options the Job is named by (report.json's ``strategy_option``).

Hydra searches conf/ before a user's directory (``--config-dir`` goes after conf/, before the
schemas; ``hydra.searchpath`` after both), so a user's ``strategy/fsdp2.yaml`` or ``train.yaml``
is never composed: conf/'s is. Torch-free."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.conf import CONF_DIR
from strategies.presets import AUTO, names

log = logging.getLogger(__name__)

HYDRAS_OWN = ("hydra", "main", "schema")
"""The search path's providers that are not a user's: Hydra's own configs, conf/, the schemas."""


@dataclass(frozen=True)
class Origin:
    choices: dict[str, str | None]
    """Group -> the option Hydra composed it from (None: switched off); Hydra's own groups left out."""
    dirs: tuple[str, ...] = ()
    """The user's config directories (``--config-dir``, ``hydra.searchpath``), in Hydra's order."""
    config_name: str = "train"
    """The top config composed (``--config-name``)."""
    overrides: tuple[str, ...] = ()
    """The job's overrides, as Hydra recorded them (``hydra.overrides.task``)."""
    search: tuple[str, ...] = field(default=(), compare=False)
    """The arguments that compose it again (``recipes.compose.search_of``)."""

    @classmethod
    def of(cls, hydra: Any) -> Origin:
        """What a Hydra node (``HydraConfig.get()``, a composition's ``cfg.hydra``) records."""
        from recipes.compose import search_of

        sources = hydra.runtime.get("config_sources") or []
        dirs = tuple(d for s in sources if s.provider not in HYDRAS_OWN and (d := _directory(s.schema, s.path)))
        choices = {str(g): (None if o is None else str(o)) for g, o in hydra.runtime.choices.items()
                   if not str(g).startswith("hydra/")}
        return cls(choices, dirs, str(hydra.job.get("config_name") or "train"),
                   tuple(str(o) for o in hydra.overrides.get("task") or ()), tuple(search_of(hydra)))

    def shadowed(self) -> list[tuple[Path, str, str, bool]]:
        """The user's files that a file of conf/ at the same place hides: (the file, its group --
        "" for a top config --, its option, whether the composition chose that option)."""
        out, conf = [], CONF_DIR.resolve()
        for d in (Path(p) for p in self.dirs):
            if not d.is_dir() or d.resolve() == conf:
                continue
            for rel in _built_ins():  # (conf/'s few files looked up there, not a walk of a user's tree)
                if (d / rel).is_file():
                    group, option = rel.parent.as_posix().strip("."), rel.stem
                    chosen = option == (self.choices.get(group) if group else self.config_name)
                    out.append((d / rel, group, option, chosen))
        return out

    def problems(self) -> list[str]:
        """A user's file that a built-in option hides, where that option is the one composed: the
        run would not be what the user wrote (train.py, plan.py and every tool alike)."""
        return [_hidden(f, group, option) for f, group, option, chosen in self.shadowed() if chosen]

    def warnings(self) -> list[str]:
        """The same of a hidden file whose option this composition did not choose."""
        return [_hidden(f, group, option) for f, group, option, chosen in self.shadowed() if not chosen]

    def sets(self, key: str) -> bool:
        """Whether the job's overrides set ``key`` (``strategy.name=...``, ``+strategy.name=...``)."""
        return any(o.lstrip("+~").partition("=")[0] == key for o in self.overrides)

    def composed_without(self, key: str) -> Any:
        """The config composed again without the overrides of ``key``: what the files make it."""
        from recipes.compose import compose

        return compose([*self.search, *(o for o in self.overrides if o.lstrip("+~").partition("=")[0] != key)])


def _hidden(f: Path, group: str, option: str) -> str:
    """One line: the user's file, the built-in Hydra composes instead, and the rename that fixes it."""
    if not group:
        return (f"{f}: the top config {option} is conf/{option}.yaml, a built-in Hydra finds before your "
                f"config directory, so this file is never composed; rename it (e.g. my_{option}.yaml "
                f"starting `defaults: [{option}, _self_]`) and pass --config-name my_{option}")
    return (f"{f}: {group}={option} is conf/{group}/{option}.yaml, a built-in option Hydra finds before your "
            f"config directory, so this file is never composed; rename it (e.g. {group}/my_{option}.yaml "
            f"starting `defaults: [{option}, _self_]`) and choose {group}=my_{option}")


def named(strategy: Any, origin: Origin | None) -> Any:
    """A preset written from its family's schema without ``name:`` (``?``) named by its option."""
    import dataclasses

    option = origin.choices.get("strategy") if origin is not None else None
    return dataclasses.replace(strategy, name=option) if strategy.name == "?" and option not in (None, AUTO) \
        else strategy


def identity_problems(strategy: Any, origin: Origin | None) -> list[str]:
    """``strategy.family`` or ``strategy.name`` set over what the preset's schema and file make them
    (``StrategyConfig.identity_problems``). Where Hydra recorded the option and the command line set
    ``strategy.name``, the name must be the file's own: a built-in option's, or a user's file's as it
    composes without the override; else a name is refused only when it is a built-in preset of
    another family."""
    option = origin.choices.get("strategy") if origin is not None else None
    if option in (None, AUTO) or not origin.sets("strategy.name"):
        return strategy.identity_problems()
    own = option if option in names() else str(origin.composed_without("strategy.name").strategy.name)
    return strategy.identity_problems(own, option=option)


_said: set[str] = set()


def warn(origin: Origin | None) -> None:
    """Log ``origin``'s warnings, each once per process (a sweep composes every point)."""
    for line in origin.warnings() if origin is not None else ():
        if line not in _said:
            _said.add(line)
            log.warning("%s", line)


@functools.cache
def _built_ins() -> tuple[Path, ...]:
    """conf/'s option files, relative to it (``strategy/fsdp2.yaml``, ``train.yaml``)."""
    return tuple(sorted(f.relative_to(CONF_DIR) for f in CONF_DIR.rglob("*.yaml")))


def _directory(schema: str, path: str) -> str | None:
    """A search path entry's directory (``file``: the path; ``pkg``: the package's), or None."""
    if schema == "file":
        return path
    if schema == "pkg":
        import importlib.util

        try:
            spec = importlib.util.find_spec(path.replace("/", "."))
        except (ImportError, ValueError):
            return None
        return next(iter(spec.submodule_search_locations or []), None) if spec else None
    return None
