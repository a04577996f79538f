"""One precision vocabulary: our names for ``trainer.precision``, the regime each means for the
tensors a step holds, and how each engine spells it -- Lightning's precision flag, Accelerate's
``mixed_precision``, the torch dtypes FSDP's mixed-precision policies and the parallelize plan
cast to, DeepSpeed's config section, what the machine benchmark times.

Every map from our names to an engine's reads ``PRECISION``; nothing else spells one. Torch-free:
dtypes are torch attribute names (``"bfloat16"``), resolved with ``dtype(name)`` where used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REGIMES = ("32", "autocast", "bf16")
"""What a precision means for the tensors a step holds (``regime``): fp32 everything, torch
autocast over fp32 parameters, or 16-bit parameters. The planner's activation calibration is
keyed by it."""


@dataclass(frozen=True)
class Precision:
    """One ``trainer.precision`` value and its spelling in each engine."""

    name: str
    """Ours: 32 | bf16-mixed | 16-mixed."""
    lightning: str
    """Lightning's ``Trainer(precision=...)`` flag (and its precision plugin's ``precision``)."""
    accelerate: str
    """Accelerate's ``mixed_precision``: no | bf16 | fp16."""
    low: str | None = None
    """The 16-bit torch dtype the mixed precision computes in (FSDP's ``param_dtype``, autocast's
    dtype, the low reduce dtype); None for fp32."""
    deepspeed: str | None = None
    """The DeepSpeed config section it enables (``{"bf16": {"enabled": true}}``); None for fp32."""

    @property
    def mixed(self) -> bool:
        return self.low is not None

    def reduce(self, fp32: bool) -> str | None:
        """The dtype gradients are reduced in: fp32 when asked (``reduce_fp32``), else the low
        dtype (None under fp32: the parameters' own)."""
        return "float32" if fp32 else self.low

    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed JSON's precision section: ``{"bf16": {"enabled": True}}``, or nothing."""
        return {self.deepspeed: {"enabled": True}} if self.deepspeed else {}

    def measured(self, accelerator: str) -> str:
        """The dtype the machine benchmark times matmuls in for this precision on ``accelerator``
        (cpu | gpu): fp32 for 32, the low dtype otherwise -- bf16 for 16-mixed on CPU, where
        there is no fp16 autocast to time."""
        if self.low is None:
            return "float32"
        return "bfloat16" if accelerator != "gpu" else self.low


PRECISION: dict[str, Precision] = {p.name: p for p in (
    Precision("32", lightning="32-true", accelerate="no"),
    Precision("bf16-mixed", lightning="bf16-mixed", accelerate="bf16", low="bfloat16", deepspeed="bf16"),
    Precision("16-mixed", lightning="16-mixed", accelerate="fp16", low="float16", deepspeed="fp16"),
)}
"""Our name -> its ``Precision``."""

PRECISIONS = tuple(PRECISION)
"""Our names, the allowed values of ``trainer.precision``."""

_BY_LIGHTNING = {p.lightning: p for p in PRECISION.values()} | {"32": PRECISION["32"]}


def of(name: str) -> Precision:
    """The ``Precision`` called ``name`` (ours)."""
    try:
        return PRECISION[str(name)]
    except KeyError:
        raise ValueError(f"precision {name!r}: allowed {', '.join(PRECISIONS)}") from None


def find(name: str) -> Precision | None:
    """The ``Precision`` called ``name``, ours or Lightning's flag for it; None for any other
    (a Lightning flag we have no name for, ``bf16-true``)."""
    return PRECISION.get(str(name)) or _BY_LIGHTNING.get(str(name))


def from_lightning(flag: str) -> str:
    """Our name for Lightning's precision flag (``32-true`` -> ``32``); a flag we have no name
    for as it is (``regime`` still reads it)."""
    p = _BY_LIGHTNING.get(str(flag))
    return p.name if p else str(flag)


def regime(precision: str, low_precision_weights: bool) -> str:
    """What a precision means for the tensors a step holds (one of ``REGIMES``): fp32
    everything, torch autocast over fp32 parameters, or 16-bit parameters (an engine that keeps
    bf16 weights beside an fp32 master copy, as DeepSpeed does, or FSDP's MixedPrecision
    gathering bf16 weights: ``StrategyConfig.low_precision_weights``; or a Lightning ``-true``
    flag)."""
    if str(precision).startswith("32"):
        return "32"
    return "bf16" if low_precision_weights or str(precision).endswith("-true") else "autocast"


def dtype(name: str | None) -> Any:
    """The torch dtype called ``name`` (``"bfloat16"``), None for None; imports torch."""
    if name is None:
        return None
    import torch

    return getattr(torch, name)


def low_dtype(precision: str) -> Any:
    """The torch 16-bit compute dtype of a mixed precision (ours or Lightning's flag), None for
    fp32 or a name we do not know."""
    p = find(precision)
    return dtype(p.low) if p else None


__all__ = ["PRECISION", "PRECISIONS", "REGIMES", "Precision", "dtype", "find", "from_lightning",
           "low_dtype", "of", "regime"]
