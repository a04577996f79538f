"""Presets are the YAML files of ``conf/strategy/``; this module resolves a name to its config.

A preset's defaults list has one of two shapes (a test keeps every file to them):
``[/<family>_schema@_here_, _self_]`` or ``[<another preset>, _self_]``. ``load`` resolves those
two shapes directly with OmegaConf -- the preset merged over its parent or over the family's
typed schema, exactly what Hydra's composition does for them (a test compares every preset
with Hydra's own result), in milliseconds instead of a Hydra compose per preset: the planner
loads every preset on each ``plan.py``. Any other shape goes through Hydra itself
(``compose_preset``), in a private Hydra context that leaves a running app untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from core.conf import CONF_DIR

STRATEGY_DIR = CONF_DIR / "strategy"
SCHEMA_SUFFIX = "_schema@_here_"


AUTO = "auto"  # conf/strategy/auto.yaml: the planner chooses (train.py), not a preset


def names() -> list[str]:
    """Every preset name: the stems of ``conf/strategy/*.yaml`` but ``auto``."""
    return sorted(p.stem for p in STRATEGY_DIR.glob("*.yaml") if p.stem != AUTO)


def node(name: str) -> Any:
    """Preset ``name`` as a typed OmegaConf node, to put in a composed config's ``strategy``."""
    if name not in names():
        raise _unknown(name)
    return _node(name).copy()


@contextmanager
def hydra_context(config_dirs: Sequence[str] = ()) -> Iterator[None]:
    """Hydra initialized on ``conf/``, restoring whatever Hydra state existed before -- the job's
    name too (initializing sets it, "app", for every job a multirun launches after: a sweep's
    jobs logged to app.log, not train.log). ``config_dirs``: a user's ``--config-dir``, searched
    where Hydra's own flag puts it (recipes/compose.py's ``search_args`` reads it): after conf/,
    before the schemas -- so a file of it named as a built-in option is not the one composed,
    in train.py or here (recipes/origin.py says so)."""
    import os

    from hydra import initialize_config_dir
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.utils import JobRuntime
    from hydra.errors import SearchPathException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup, name = get_gh_backup(), JobRuntime.instance().get("name")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            if config_dirs:  # (as Hydra's --config-dir: before the schemas, and a missing one refused)
                search = create_config_search_path(str(CONF_DIR))
                for config_dir in config_dirs:
                    if not os.path.isdir(config_dir):
                        raise SearchPathException(f"Additional config directory '{config_dir}' not found")
                    search.prepend(provider="command-line", path=f"file://{config_dir}",
                                   anchor=SearchPathQuery(provider="schema"))
                GlobalHydra.instance().clear()
                Hydra.create_main_hydra2(task_name="app", config_search_path=search)
            yield
    finally:
        restore_gh_from_backup(backup)
        JobRuntime.instance().set("name", name)


def _unknown(name: str) -> Exception:
    """train.py's line for a mistyped preset (``strategy=fsdp_2: no such strategy; did you mean fsdp2?
    (strategy=fsdp2); the options: ...``)."""
    from core.errors import ConfigError, no_such_option

    return ConfigError(no_such_option("strategy", name, names()))


def preset_family(name: str) -> str | None:
    """The family of built-in preset ``name`` (``auto``'s placeholder too); None for any other name."""
    return _node(name).get("family") if name == AUTO or name in names() else None


@functools.cache
def _yaml(name: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.load(STRATEGY_DIR / f"{name}.yaml")


@functools.cache
def _schema(family: str) -> Any:
    from omegaconf import OmegaConf

    from strategies.base import family_of

    return OmegaConf.structured(family_of(family)(family=family))


def parent(name: str) -> str | None:
    """What preset ``name`` extends: ``/<family>_schema`` or another preset's name; None when its
    defaults list is not one of the two direct shapes."""
    defaults = _yaml(name).get("defaults")
    if defaults is None or len(defaults) != 2 or defaults[1] != "_self_" or not isinstance(defaults[0], str):
        return None
    first = defaults[0]
    if first.startswith("/") and first.endswith(SCHEMA_SUFFIX):
        return first[: -len("@_here_")]
    return first if first in names() else None


@functools.cache
def _node(name: str) -> Any:
    """The preset's merged, typed OmegaConf node (cached: files do not change under a run)."""
    from omegaconf import OmegaConf

    up = parent(name)
    if up is None:
        return compose_preset(name)
    base = _schema(up[1:].removesuffix("_schema")) if up.startswith("/") else _node(up)
    own = OmegaConf.masked_copy(_yaml(name), [k for k in _yaml(name) if k != "defaults"])
    return OmegaConf.merge(base, own)


def overrides_of(preset: Any) -> tuple[str, list[str]]:
    """The built-in preset and the ``strategy.<key>=<value>`` overrides (as on train.py's command
    line) that make ``load(name, overrides)`` equal ``preset``: every key, nested ones of a mapping
    (``deepspeed_config``) leaf by leaf, whose value is not that preset's own. ``preset.name``
    when it is built in; a user's own (a file in their config directory, which a hook composing
    from conf/ cannot see), the built-in preset of its family it differs least from. What a user's
    hook is given to build the preset a job ran or exported (backends/accelerate/export.py)."""
    import dataclasses

    def leaves(value: Any, key: str) -> dict[str, Any]:
        if isinstance(value, dict) and value:
            return {k: v for sub, item in value.items() for k, v in leaves(item, f"{key}.{sub}").items()}
        return {key: value}

    mine = leaves(dataclasses.asdict(preset), "strategy")

    def against(name: str) -> list[str]:
        own = leaves(dataclasses.asdict(load(name)), "strategy")
        return [f"{k}={_spelled(v)}" for k, v in mine.items()
                if k != "strategy.name" and (k not in own or own[k] != v)]

    if preset.name in names():
        return preset.name, against(preset.name)
    kin = [n for n in names() if _node(n).get("family") == preset.family] or names()
    return min(((n, against(n)) for n in kin), key=lambda pair: (len(pair[1]), pair[0]))


def label(preset: Any, option: str) -> str:
    """How the plan line, the log and the export name ``preset`` chosen as strategy ``option`` (a
    file of conf/strategy/ or of the user's own config directory): the option alone where it is the
    preset's name; a user's option over a built-in preset with the built-in and the keys it changes
    (``my_fsdp (fsdp2 + reshard_after_forward=false)``: ``name`` is the built-in's, which its
    name-keyed behaviour follows), the first three of them."""
    if option == preset.name:
        return option
    if preset.name not in names():
        return option if preset.name == "?" else f"{option} ({preset.name})"
    base, changed = overrides_of(preset)
    keys = [c.removeprefix("strategy.") for c in changed]
    more = f", +{len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{option} ({base}{' + ' + ', '.join(keys[:3]) + more if keys else ''})"


def _spelled(value: Any) -> str:
    """``value`` as an override's right-hand side that OmegaConf reads back as ``value``."""
    import json

    from omegaconf import OmegaConf

    if isinstance(value, str):
        return value if OmegaConf.from_dotlist([f"v={value}"]).v == value else json.dumps(value)
    return json.dumps(value)


def compose_preset(name: str) -> Any:
    """Preset ``name`` composed by Hydra (the reference ``load`` agrees with)."""
    import hydra

    import strategies  # noqa: F401  (imports every family, which stores its schema)

    with hydra_context():
        return hydra.compose(config_name=None, overrides=[f"+strategy={name}"]).strategy


def load(name: str, overrides: Sequence[str] = ()) -> Any:
    """The typed config (a ``StrategyConfig`` subclass instance) of preset ``name``, with
    ``overrides`` (``strategy.<key>=<value>``, as on train.py's command line) applied; a
    ``ConfigError`` naming an override that is not one of the preset's keys (with train.py's "did you
    mean"), not its type, or one of the two keys the preset fixes (``family``, ``name``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from core import knobs
    from core.errors import ConfigError, no_such_key
    from strategies.base import as_config

    if name not in names():
        raise _unknown(name)
    node, bad = _node(name), [o for o in overrides if not o.startswith("strategy.") or "=" not in o]
    if bad:
        raise ConfigError([f"{o!r}: not strategy.<key>=<value> (a preset key, as on train.py's command "
                           "line)" for o in bad])
    keys = [str(k) for k in node]
    if unknown := [no_such_key(key, value, keys) for key, _, value in (o.partition("=") for o in overrides)
                   if key.split(".")[1] not in keys]:
        raise ConfigError(unknown)  # (train.py's lines: recipes/cli_help.py)
    for o in overrides:
        try:
            node = OmegaConf.merge(node, OmegaConf.from_dotlist([o.removeprefix("strategy.")]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"{o}: {str(e).splitlines()[0]}; strategy={name}'s keys: {', '.join(keys)}") from None
    preset = as_config(node)
    if overrides and (found := preset.identity_problems(name) + knobs.problems(preset, "strategy")
                      + preset.value_problems()):
        raise ConfigError(found)
    return preset
