"""The Lightning backend: a validated ``Job`` -> a Trainer, the recipe's module and data, the
observers behind one callback; Lightning runs the loop of this rank (``trainer.py``).

Its builders, one per strategy family it runs, are in ``families/``; the pipeline runner in
``pipeline.py``; the registration of our presets in Lightning's registry in ``registry.py``.
This module stays light (Lightning is imported by the functions below), because importing the
registry module runs it while Lightning itself is still being imported.

A user's own Lightning script on a preset with keys of its own (the registry's names carry none):

    from backends.lightning import stratagem_strategy

    Trainer(strategy=stratagem_strategy("ddp_int8", "strategy.find_unused_parameters=true"))
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.lightning.registry import stratagem_strategy

__all__ = ["stratagem_strategy", "load_engine", "problems", "build", "fit", "forget"]

if TYPE_CHECKING:
    from backends import Outcome
    from observers import Observers
    from recipes.job import Job


def load_engine() -> None:
    """Lightning, as this backend imports it (``torchmetrics_imports``)."""
    from backends.lightning.torchmetrics_imports import import_lightning

    import_lightning()


def problems(job: Job) -> list[str]:
    from backends.lightning import families

    return families.problems(job.strategy)


def build(job: Job, out: Path, observers: Observers) -> Any:
    from backends.lightning import trainer

    return trainer.build(job, out, observers)


def fit(built: Any) -> Outcome:
    from backends.lightning import trainer

    return trainer.fit(built)


def forget(built: Any) -> None:
    """After a run (``backends.leave_nothing``): the DeepSpeed engine Lightning's strategy built,
    destroyed (its hooks would keep the run's model and optimizer alive in this process).
    Lightning keeps no process-wide state of its own; the env:// variables its DeepSpeed
    strategy sets for a group of one are ``leave_nothing``'s."""
    from backends.common.deepspeed import destroy

    destroy(getattr(getattr(getattr(built, "trainer", None), "strategy", None), "model", None))
