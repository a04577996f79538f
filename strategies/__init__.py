"""Strategy plugins: typed, engine-neutral configs (topology, problems, footprint, parallelize
plan), one module per family in ``strategies/families/``, presets as the YAML of conf/strategy/.

Importing this package is light (no torch, no engine): it imports every family module (each
registers itself and stores its schema for Hydra). For users of plain Lightning, it also arranges
for every preset to join Lightning's ``StrategyRegistry`` as soon as Lightning's strategies load
(at once if they already have): ``lightning.Trainer(strategy="zero3")`` then works in a user's own
script. That is the one reference from here to a backend, by module name and deferred: the
Lightning backend owns the registration (``backends/lightning/registry.py``) and its builders;
nothing of Lightning is imported unless the user imports Lightning.
"""

from __future__ import annotations

import importlib
import pkgutil

from strategies import families as _families
from strategies.base import Capabilities, StrategyConfig, as_config, families, family
from core.hooks import after_import
from core.errors import ConfigError
from core.mesh import Batch, Mesh
from strategies.presets import load, names
from core.run import Run, derive, derive_from

for _module in sorted(m.name for m in pkgutil.iter_modules(_families.__path__)):
    importlib.import_module(f"strategies.families.{_module}")

__all__ = ["Batch", "Capabilities", "ConfigError", "Mesh", "Run", "StrategyConfig", "as_config",
           "derive", "derive_from", "families", "family", "load", "names"]

after_import("lightning.pytorch.strategies", then="backends.lightning.registry:register")
