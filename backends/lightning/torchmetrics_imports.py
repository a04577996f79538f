"""Import Lightning without the ``transformers`` import torchmetrics makes for metrics we never use.

Lightning imports torchmetrics, and torchmetrics imports transformers' model classes at import
time whenever transformers is installed, for BERTScore, InfoLM and CLIPScore (torchmetrics#2242,
still so in 1.9): about 2 s per process on a 2-core machine, in every rank of every job once the
``hf`` extra is installed, though only ``model=hf`` uses transformers.

While Lightning is first imported, ``transformers`` is a stand-in module whose names are
``_Deferred``: each imports the real library on first use (a call, an attribute, ``isinstance``),
so those metrics still work if a user calls them. The stand-in is removed as soon as Lightning is
in; every later ``import transformers`` (recipes/hf.py, a user's code) is the real library. When
transformers or torchmetrics is already imported, or not installed, Lightning is imported as is.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

_NAME = "transformers"


class _Deferred:
    """A name of transformers, resolved on first use."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _real(self) -> Any:
        return getattr(importlib.import_module(_NAME), self._name)

    def __getattr__(self, attr: str) -> Any:
        if attr == "_name":  # (copy/pickle probe before __init__ ran)
            raise AttributeError(attr)
        return getattr(self._real(), attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def __instancecheck__(self, obj: object) -> bool:
        return isinstance(obj, self._real())

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, self._real())

    def __repr__(self) -> str:
        return f"<{_NAME}.{self._name}, imported on first use>"


def _stand_in(spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    module = types.ModuleType(_NAME)
    module.__spec__ = spec  # (importlib.util.find_spec reads it while the stand-in is in place)

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Deferred(name)

    module.__getattr__ = __getattr__
    return module


def import_lightning() -> types.ModuleType:
    """``import lightning``, with torchmetrics' transformers names deferred (see the module)."""
    already = _NAME in sys.modules or "torchmetrics" in sys.modules
    spec = None if already else importlib.util.find_spec(_NAME)
    if spec is None:  # nothing to defer
        return importlib.import_module("lightning")
    stand_in = sys.modules[_NAME] = _stand_in(spec)
    try:
        return importlib.import_module("lightning")
    finally:
        if sys.modules.get(_NAME) is stand_in:
            del sys.modules[_NAME]
