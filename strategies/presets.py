"""Presets are the YAML files of ``conf/strategy/``; this module resolves a name to its config.

Composition goes through Hydra itself (so ``defaults: [zero3]`` inheritance means exactly what
it means to ``train.py``), in a private Hydra context that leaves a running app untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def names() -> list[str]:
    """Every preset name: the stems of ``conf/strategy/*.yaml``."""
    return sorted(p.stem for p in (CONF_DIR / "strategy").glob("*.yaml"))


@contextmanager
def hydra_context() -> Iterator[None]:
    """Hydra initialized on ``conf/``, restoring whatever Hydra state existed before."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            yield
    finally:
        restore_gh_from_backup(backup)


def load(name: str) -> Any:
    """The typed config (a ``StrategyConfig`` subclass instance) of preset ``name``."""
    from strategies.base import as_config

    if name not in names():
        raise KeyError(f"strategy={name!r} is not a preset; available: {', '.join(names())} "
                       f"(each is a file in {CONF_DIR / 'strategy'})")
    import hydra

    import strategies  # noqa: F401  (imports every family, which stores its schema)

    with hydra_context():
        node = hydra.compose(config_name=None, overrides=[f"+strategy={name}"]).strategy
    return as_config(node)
