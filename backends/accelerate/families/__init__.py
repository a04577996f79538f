"""Accelerate's builders, one module per strategy family (found here, not listed): a ``Builder``
registered for the family's config class with ``@builds``, turning a preset and its run into
``accelerate.Accelerator`` arguments (plugins, kwargs handlers) and the few things the loop asks
of the engine around them. A family whose module only refuses (``problems``) is not run here.
"""

from __future__ import annotations

import contextlib
from typing import Any

from backends.common import torch as torch_common
from backends.common.builders import Builders
from strategies import StrategyConfig
from parallel.parallelize import parallelize, plan_for
from core.run import Run


class Builder:
    """A preset on Accelerate. The default: plain data parallel (Accelerate's DDP), or one
    process; the preset's plan applied to the model before ``prepare``."""

    def __init__(self, preset: StrategyConfig, run: Run):
        self.preset, self.run = preset, run

    def problems(self) -> list[str]:
        """Why Accelerate cannot run this preset here (empty: it can)."""
        return []

    def kwargs(self, block_cls: type | str | int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``accelerate.Accelerator``; ``block_cls``: the model's repeated
        block, a class or its name, or an int: wrap by size (FSDP wrap policies, ``wrap_policy``)."""
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

    def clip(self, acc: Any, model: Any, max_norm: float) -> Any:
        """The global gradient norm before clipping, and the gradients clipped to ``max_norm`` (0:
        measured only), at the accumulation boundary: the same exact measure as the Lightning
        presets' (``parallel.clip.clip_global_``), over plain or DTensor gradients, after
        Accelerate unscales fp16's (``accelerator.clip_grad_norm_``'s own first step)."""
        from parallel.clip import clip_global_

        acc.unscale_gradients()
        return clip_global_(list(model.parameters()), max_norm)

    def held_bytes(self, model: Any, optimizers: list[Any], what: str) -> int:
        return torch_common.held_bytes(model, optimizers, what)

    def full_state_dict(self, model: Any) -> dict[str, Any]:
        return torch_common.full_state_dict(model)


BUILDERS = Builders(__name__, __path__, "accelerate", ": use backend=lightning or another preset")
builds = BUILDERS.builds
"""Class decorator: this ``Builder`` runs presets of ``config_cls`` on Accelerate."""


def builder(preset: StrategyConfig, run: Run) -> Builder | None:
    cls = BUILDERS.get(preset)
    return None if cls is None else cls(preset, run)


def problems(preset: StrategyConfig, run: Run) -> list[str]:
    b = builder(preset, run)
    return BUILDERS.missing(preset) if b is None else b.problems()
