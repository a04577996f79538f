"""The ranks of one machine, started from plain ``python train.py`` through torch's elastic
launch API (what torchrun and ``accelerate launch`` use themselves). Under ``torchrun`` or
``accelerate launch`` the environment already says which rank this process is, and nothing is
started here (``launched``).

The ranks run a function, not a second train.py: the validated job is handed over as it is, so
a rank never re-parses the command line (a sweep's command line would start the sweep again,
the trap of re-executing launchers) and never recomposes. On CPU the ranks are forked from this
process, which has imported torch and the engine already (seconds saved per run); on a GPU they
are spawned, since a forked process cannot use CUDA once its parent has.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recipes.job import Job

LAUNCHED = ("LOCAL_RANK", "RANK", "WORLD_SIZE")


def launched() -> bool:
    """This process is a rank a launcher started (torchrun, accelerate launch, ours)."""
    return all(v in os.environ for v in LAUNCHED)


def _rank(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    from backends import run
    from recipes.cli import rank_aware_logging

    rank_aware_logging()
    return run(job, out, plan)


def run_local_ranks(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    """Start the job's ranks on this machine, wait for them and return rank 0's outcome; a
    failed rank raises (torch's ChildFailedError names it)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=job.world.devices,
                          run_id=uuid.uuid4().hex, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                          max_restarts=0, monitor_interval=0.5,
                          start_method="fork" if job.run.accelerator == "cpu" else "spawn")
    return elastic_launch(config, _rank)(job, out, plan)[0]
