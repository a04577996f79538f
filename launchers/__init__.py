"""Launching: how the ranks of a job start. Separate from strategies and backends: a backend
trains one rank; a launcher decides where and how many.

- ``local``: plain ``python train.py`` with more than one process -- the ranks of this machine
  through torch's elastic launch API (what torchrun uses), each running the job it is handed.
- already launched (``torchrun``, ``accelerate launch``): this process is a rank; nothing starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launchers.local import RankLost, launched, restart_problem, run_local_ranks

if TYPE_CHECKING:
    from recipes.job import Job

__all__ = ["RankLost", "check", "launched", "restart_problem", "run_local_ranks"]


def check(job: Job) -> list[str]:
    """What no launcher here can start (for ``recipes.job.validate(extra=...)``)."""
    if job.world.nodes > 1 and not launched():
        return [f"cluster.nodes={job.world.nodes}: plain `python train.py` starts the ranks of one "
                "machine; start every node with its own launcher (torchrun --nnodes "
                f"{job.world.nodes} --node-rank <i> ... train.py ..., or accelerate launch)"]
    return []
