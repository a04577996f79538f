"""Lightning's builders, one module per strategy family it runs (found here, not listed): a
Lightning ``Strategy`` subclass with ``backends.lightning.preset.PresetStrategy`` first in its
bases, registered for the family's config class with ``@builds``. A config reaches its builder
by class, never by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from backends.lightning.torchmetrics_imports import import_lightning

import_lightning()  # before any Lightning import of the builders: see torchmetrics_imports

from strategies import ConfigError, StrategyConfig  # noqa: E402
from strategies.run import Run  # noqa: E402

_BUILDERS: dict[type, type] = {}


def builds(config_cls: type[StrategyConfig]):
    """Class decorator: this Lightning strategy builds presets of ``config_cls``."""

    def register(strategy_cls: type) -> type:
        _BUILDERS[config_cls] = strategy_cls
        return strategy_cls

    return register


def _discover() -> None:
    if not getattr(_discover, "done", False):
        for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
            importlib.import_module(f"{__name__}.{module}")
        _discover.done = True


def builder_for(config: StrategyConfig) -> type | None:
    _discover()
    return next((_BUILDERS[c] for c in type(config).__mro__ if c in _BUILDERS), None)


def problems(config: StrategyConfig) -> list[str]:
    if builder_for(config) is None:
        return [f"strategy={config.name} ({config.family} family) has no builder in backend=lightning"
                + ("; it is planned only (python plan.py prices it)" if config.capabilities.planned_only
                   else ": choose another preset or backend")]
    return []


def build(config: StrategyConfig, run: Run | None = None) -> Any:
    """The Lightning strategy for ``config`` (``run``: when known, see ``PresetStrategy.of``)."""
    if problems(config):
        raise ConfigError(problems(config))
    return builder_for(config).of(config, run)
