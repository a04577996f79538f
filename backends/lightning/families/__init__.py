"""Lightning's builders, one module per strategy family it runs (found here, not listed): a
Lightning ``Strategy`` subclass with ``backends.lightning.preset.PresetStrategy`` first in its
bases, registered for the family's config class with ``@builds``. A config reaches its builder
by class, never by name.
"""

from __future__ import annotations

from typing import Any

from backends.lightning.torchmetrics_imports import import_lightning

import_lightning()  # before any Lightning import of the builders: see torchmetrics_imports

from backends.common.builders import Builders  # noqa: E402
from strategies import ConfigError, StrategyConfig  # noqa: E402
from core.run import Run  # noqa: E402

BUILDERS = Builders(__name__, __path__, "lightning", ": choose another preset or backend")
builds = BUILDERS.builds
"""Class decorator: this Lightning strategy builds presets of ``config_cls``."""


def builder_for(config: StrategyConfig) -> type | None:
    return BUILDERS.get(config)


def problems(config: StrategyConfig) -> list[str]:
    return BUILDERS.missing(config)


def build(config: StrategyConfig, run: Run | None = None) -> Any:
    """The Lightning strategy for ``config`` (``run``: when known, see ``PresetStrategy.of``)."""
    if problems(config):
        raise ConfigError(problems(config))
    return builder_for(config).of(config, run)
