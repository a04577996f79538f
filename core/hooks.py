"""Run a function right after a module is imported, without importing that module: a one-shot
import hook. ``import strategies`` uses it once, so that Lightning users get the presets in
Lightning's registry whichever they import first (strategies/__init__.py), while plan.py and
``--cfg job`` never import Lightning. The function is named ``"package.module:function"`` and is
imported only when it runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys


def _call(target: str) -> None:
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)()


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Let ``module`` load as usual, then call ``target``."""

    def __init__(self, module: str, target: str) -> None:
        self.module, self.target, self.loader = module, target, None

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _call(self.target)


def after_import(module: str, *, then: str) -> None:
    """Call ``then`` once ``module`` is imported: now if it already is, else right after."""
    if module in sys.modules:
        _call(then)
    elif not any(isinstance(f, _AfterImport) and f.module == module for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(module, then))
