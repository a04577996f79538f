"""Import Lightning without the imports torchmetrics makes for metrics we never use.

Lightning imports torchmetrics (``lightning.fabric.utilities.imports`` compares its version by
importing it), and torchmetrics imports, at import time:

- transformers' model classes whenever transformers is installed, for BERTScore, InfoLM and
  CLIPScore (torchmetrics#2242, still so in 1.9): about 2 s per process on a 2-core machine once
  the ``hf`` extra is installed, though only ``model=hf`` uses transformers;
- ``scipy.signal`` (with ``scipy.stats``) for its audio metrics: about 1.5 s per process.

While Lightning is first imported, each is a stand-in module whose names are ``_Deferred``: each
imports the real module on first use (a call, an attribute, ``isinstance``), so those metrics
still work if a user calls them. The stand-ins are removed as soon as Lightning is in; every
later import (recipes/hf.py, a user's code) is the real module. A module already imported, or
not installed, is not deferred. (torchmetrics' ``scipy.signal.hamming`` back-compatibility patch,
for SRMR's dependency on scipy < 1.13, sees the stand-in's name and is skipped.)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

DEFERRED = ("transformers", "scipy.signal")
_NAME = DEFERRED[0]


class _Deferred:
    """A name of transformers, resolved on first use."""

    def __init__(self, name: str, module: str = _NAME) -> None:
        self._name, self._module = name, module

    def _real(self) -> Any:
        return getattr(importlib.import_module(self._module), self._name)

    def __getattr__(self, attr: str) -> Any:
        if attr in ("_name", "_module"):  # (copy/pickle probe before __init__ ran)
            raise AttributeError(attr)
        return getattr(self._real(), attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def __instancecheck__(self, obj: object) -> bool:
        return isinstance(obj, self._real())

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, self._real())

    def __repr__(self) -> str:
        return f"<{self._module}.{self._name}, imported on first use>"


def _stand_in(name: str, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = spec  # (importlib.util.find_spec reads it while the stand-in is in place)

    def __getattr__(attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return _Deferred(attr, name)

    module.__getattr__ = __getattr__
    return module


def _findable(name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except ImportError:  # (a submodule whose package is not installed)
        return None


def import_lightning() -> types.ModuleType:
    """``import lightning``, with torchmetrics' transformers and scipy.signal names deferred (see
    the module)."""
    if "torchmetrics" in sys.modules:  # (its imports are done)
        return importlib.import_module("lightning")
    stand_ins = {name: _stand_in(name, spec) for name in DEFERRED
                 if name not in sys.modules and (spec := _findable(name)) is not None}
    sys.modules.update(stand_ins)
    try:
        return importlib.import_module("lightning")
    finally:
        for name, stand_in in stand_ins.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
