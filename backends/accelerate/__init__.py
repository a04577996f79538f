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
    accelerator: Any = None
    """The run's Accelerator, once ``loop.train`` made it (``forget`` frees what it holds)."""


def load_engine() -> None:
    """Accelerate (with torch), and ``torch._dynamo``: torch imports it lazily at the first
    optimizer's construction (``torch._disable_dynamo``; ~2 s and ~75 MB cold), which ``import
    lightning`` pulls in already. Imported here it is import time on both backends -- not
    model_build (nor checkpoint_load on a resume), and not the run's memory (peak_rss_run)."""
    import accelerate  # noqa: F401
    import torch._dynamo  # noqa: F401


def forget(built: Built | None) -> None:
    """After a run (``backends.leave_nothing``): what the Accelerator holds freed by Accelerate's
    own ``free_memory`` (a DeepSpeed engine destroyed: its hooks would keep the run's model and
    optimizer alive in this process), then its state singletons cleared, as its own test case's
    ``tearDown`` does: ``PartialState`` and ``AcceleratorState`` are shared by every instance in
    the process, and ``PartialState(cpu=True)`` would hand the next job in this process (a
    sweep's) the last one's distributed type and mixed precision ("Accelerate built ['NO'] ...
    but the preset needs DEEPSPEED", "AcceleratorState has already been initialized")."""
    from accelerate.state import AcceleratorState, GradientState

    if built is not None and built.accelerator is not None:
        built.accelerator.free_memory()
        built.accelerator = None
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def problems(job: Job) -> list[str]:
    from backends.accelerate import families

    return families.problems(job.strategy, job.run)


def build(job: Job, out: Path, observers: Observers) -> Built:
    """Nothing to build ahead: the Accelerator must come first (it joins the process group),
    then the model and optimizer (``loop.train``)."""
    return Built(job, out, observers)


def fit(built: Built) -> Outcome:
    from backends.accelerate.loop import train

    return train(built.job, built.out, built.observers, built)


def stratagem_accelerator(strategy: str, *overrides: str, **options: Any) -> Any:
    """A user's Accelerate script on preset ``strategy``, with the preset's keys as on train.py's
    command line (``"strategy.sync_every=2"``): an ``accelerate.Accelerator`` whose ``prepare``
    runs it for real (backends/accelerate/user.py)."""
    from backends.accelerate.user import stratagem_accelerator as build

    return build(strategy, *overrides, **options)
