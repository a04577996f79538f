"""The one config-class -> builder registry every engine uses: each backend keeps its own
instance (its ``families/`` package, one module per strategy family, found there, not listed),
and a config reaches its builder by class, never by name -- the nearest class in the config's
MRO that has one, so a family subclassing another runs on that one's builder until it brings
its own."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from typing import Any


class Builders:
    """The builders of one engine: ``builds(ConfigClass)`` registers, ``get(config)`` finds.

    ``package``/``path``: the engine's ``families`` package (``__name__``, ``__path__``), whose
    modules are imported once, on the first lookup; ``backend``: its name in ``backend=``;
    ``otherwise``: what the refusal suggests instead."""

    def __init__(self, package: str, path: Iterable[str], backend: str, otherwise: str):
        self.package, self.path, self.backend, self.otherwise = package, list(path), backend, otherwise
        self._by_config: dict[type, Any] = {}
        self._found = False

    def builds(self, config_cls: type) -> Callable[[Any], Any]:
        """Class decorator: the decorated builder runs presets of ``config_cls`` on this engine."""

        def register(builder: Any) -> Any:
            self._by_config[config_cls] = builder
            return builder

        return register

    def _discover(self) -> None:
        if not self._found:
            for module in sorted(m.name for m in pkgutil.iter_modules(self.path)):
                importlib.import_module(f"{self.package}.{module}")
            self._found = True

    def get(self, config: Any) -> Any | None:
        """The builder registered for ``config``'s class or its nearest base; None: none."""
        self._discover()
        return next((self._by_config[c] for c in type(config).__mro__ if c in self._by_config), None)

    def missing(self, config: Any) -> list[str]:
        """The one sentence when ``config`` has no builder here; empty when it has one."""
        if self.get(config) is not None:
            return []
        return [f"strategy={config.name} ({config.family} family) has no builder in backend={self.backend}"
                + ("; it is planned only (python plan.py prices it)" if config.capabilities.planned_only
                   else self.otherwise)]
