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


TRUE_PRECISION = {"64-true": "float64", "32-true": "float32", "bf16-true": "bfloat16", "16-true": "float16"}
"""Lightning's true-precision flags -> the dtype their DeepSpeed and FSDP precision plugins cast
the whole module to (``convert_module``: ``module.to(dtype)``) before the engine wraps it."""

KEEPS = {"bfloat16": "bf16-true", "float16": "16-true", "float32": "32-true", "float64": "64-true"}


def cast_warning(module: Any, precision: str, strategy: str) -> str | None:
    """The sentence for a module whose floating parameters Lightning's precision plugin of
    ``precision`` casts to another dtype at setup (zero*, stratagem_fsdp: ``convert_module``;
    DDP leaves them), None when it casts none: how many, a few names, to what, and the fix."""
    import torch

    if precision not in TRUE_PRECISION:
        return None
    to = TRUE_PRECISION[precision]
    cast = [(n, p) for n, p in module.named_parameters()
            if p.is_floating_point() and p.dtype != getattr(torch, to)]
    if not cast:
        return None
    held = sorted({str(p.dtype).removeprefix("torch.") for _, p in cast})
    names = ", ".join(n for n, _ in cast[:3]) + (", ..." if len(cast) > 3 else "")
    fix = (f'Trainer(precision="{KEEPS[held[0]]}") keeps {held[0]}' if len(held) == 1 and held[0] in KEEPS
           else "give every parameter one dtype and the Trainer its precision")
    return (f"strategy={strategy}, Trainer(precision=\"{precision}\"): Lightning's precision plugin casts "
            f"{len(cast)} of the module's parameters ({sum(getattr(p, 'ds_numel', p.numel()) for _, p in cast):,} values; "
            f"{'/'.join(held)}: {names}) to {to} before training -- their memory changes with it, and a "
            f"forward that casts its input to a layer's dtype then fails (\"mat1 and mat2 must have the "
            f"same dtype\"); {fix}, or cast the module to {to} yourself to train it so")


def warn_cast(strategy: Any) -> None:
    """``cast_warning`` for the strategy's module, once, on rank 0 (called first in ``setup``)."""
    from lightning.pytorch.utilities import rank_zero_warn

    flag = str(getattr(strategy.precision_plugin, "precision", ""))
    if (text := cast_warning(strategy.model, flag, strategy.preset.name)) is not None:
        rank_zero_warn(text)
