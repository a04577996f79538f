"""Accelerate's builders, one module per strategy family (found here, not listed): a ``Builder``
registered for the family's config class with ``@builds``, turning a preset and its run into
``accelerate.Accelerator`` arguments (plugins, kwargs handlers) and the few things the loop asks
of the engine around them. A family whose module only refuses (``problems``) is not run here.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from typing import Any

from backends.common import torch as torch_common
from strategies import StrategyConfig
from strategies.parallelize import parallelize, plan_for
from strategies.run import Run

_BUILDERS: dict[type, type[Builder]] = {}


class Builder:
    """A preset on Accelerate. The default: plain data parallel (Accelerate's DDP), or one
    process; the preset's plan applied to the model before ``prepare``."""

    def __init__(self, preset: StrategyConfig, run: Run):
        self.preset, self.run = preset, run

    def problems(self) -> list[str]:
        """Why Accelerate cannot run this preset here (empty: it can)."""
        return []

    def kwargs(self, block_cls: type | None = None) -> dict[str, Any]:
        """Keyword arguments for ``accelerate.Accelerator``; ``block_cls``: the model's repeated
        block (wrap policies)."""
        return {}

    def model_context(self, kwargs: dict[str, Any]) -> Any:
        """The context the model is built in (DeepSpeed ZeRO-3: ``zero.Init``)."""
        return contextlib.nullcontext()

    gather_parameters: Any = None
    """How a model writes whole tensors into partitioned parameters (ZeRO-3), or None."""

    def parallelize(self, model: Any) -> Any:
        """The preset's plan on the plain model, before ``prepare`` wraps it."""
        return parallelize(model, plan_for(self.preset, self.run), precision=self.run.precision)

    def repair(self, model: Any, optimizer: Any) -> None:
        """Fix-ups the engine needs once prepared."""

    def data_rank(self, rank: int, world: int) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size) of process ``rank``: which samples it reads."""
        return rank, world

    def sequence_shard(self, rank: int) -> tuple[int, int] | None:
        """(rank, degree) of process ``rank``'s sequence shard (Ulysses), None: whole samples."""
        return None

    def before_step(self, model: Any) -> None:
        """Before each optimizer step's micro-batches (ddp's relaxed synchronization)."""

    def after_step(self, model: Any) -> None:
        """After each optimizer step (ddp's local SGD / DiLoCo parameter synchronization)."""

    def held_bytes(self, model: Any, optimizers: list[Any], what: str) -> int:
        return torch_common.held_bytes(model, optimizers, what)

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        return torch_common.full_state_dict(model)


def builds(config_cls: type[StrategyConfig]):
    """Class decorator: this ``Builder`` runs presets of ``config_cls`` on Accelerate."""

    def register(builder: type[Builder]) -> type[Builder]:
        _BUILDERS[config_cls] = builder
        return builder

    return register


def _discover() -> None:
    if not getattr(_discover, "done", False):
        for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
            importlib.import_module(f"{__name__}.{module}")
        _discover.done = True


def builder(preset: StrategyConfig, run: Run) -> Builder | None:
    _discover()
    cls = next((_BUILDERS[c] for c in type(preset).__mro__ if c in _BUILDERS), None)
    return None if cls is None else cls(preset, run)


def problems(preset: StrategyConfig, run: Run) -> list[str]:
    b = builder(preset, run)
    if b is None:
        return [f"strategy={preset.name} ({preset.family} family) has no builder in backend=accelerate"
                + ("; it is planned only (python plan.py prices it)" if preset.capabilities.planned_only
                   else ": use backend=lightning or another preset")]
    return b.problems()
