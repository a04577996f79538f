"""The Accelerate backend: the same ``strategy=...`` on Hugging Face Accelerate.

    python train.py backend=accelerate strategy=fsdp cluster.devices=2
    accelerate launch --config_file <exported yaml> train.py backend=accelerate strategy=fsdp ...

Each family's builder (``families/``) turns the preset into Accelerator arguments (DDP kwargs and
comm hooks, the FSDP plugin for FSDP1 and FSDP2, the DeepSpeed plugin fed by the same DeepSpeed
config as the Lightning path); ``state.py`` builds the Accelerator so those run for real on CPU
too. The backend trains one rank: started from plain ``python train.py``, the
ranks come from ``launchers.local``; under ``torchrun`` or ``accelerate launch`` the process is
a rank already. Export of native configs: ``export.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends import Outcome

if TYPE_CHECKING:
    from observers import Observers
    from recipes.job import Job


@dataclass
class Built:
    job: Job
    out: Path
    observers: Observers


def load_engine() -> None:
    """Accelerate (with torch)."""
    import accelerate  # noqa: F401


def problems(job: Job) -> list[str]:
    from backends.accelerate import families

    return families.problems(job.strategy, job.run)


def build(job: Job, out: Path, observers: Observers) -> Built:
    """Nothing to build ahead: the Accelerator must come first (it joins the process group),
    then the model and optimizer (``loop.train``)."""
    return Built(job, out, observers)


def fit(built: Built) -> Outcome:
    from backends.accelerate.loop import train

    return train(built.job, built.out, built.observers)


def stratagem_accelerator(strategy: str, **options: Any) -> Any:
    """A user's Accelerate script on preset ``strategy``: an ``accelerate.Accelerator`` whose
    ``prepare`` runs it for real (backends/accelerate/user.py)."""
    from backends.accelerate.user import stratagem_accelerator as build

    return build(strategy, **options)
