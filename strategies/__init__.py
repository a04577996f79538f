"""Strategy plugins: typed configs that build engine strategies, plus the layout data the
planner and observers read.

Importing this package is light (no torch, no Lightning): it stores each family's schema for
Hydra and arranges for every preset of ``conf/strategy/`` to be registered in Lightning's
``StrategyRegistry`` as soon as Lightning is imported (at once if it already is), so
``lightning.Trainer(strategy="zero3")`` works in a user's own script. The registry entry is a
small factory: the preset's YAML is composed only when Lightning asks for it, and heavy
libraries (DeepSpeed) are imported only then.
"""

from __future__ import annotations

from strategies import ddp, fsdp, fsdp2, parallel, single, zero  # noqa: F401  (each family registers itself)
from strategies.base import Layout, Run, StrategyConfig, as_config, families, family
from strategies.lightning_support import register_when_lightning_loads
from strategies.mesh import Batch, ConfigError, World
from strategies.presets import load, names

__all__ = ["Batch", "ConfigError", "Layout", "Run", "StrategyConfig", "World", "as_config",
           "families", "family", "load", "names"]

register_when_lightning_loads()
