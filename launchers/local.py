"""The ranks of one machine -- one node of the job -- started from plain ``python train.py``
through torch's elastic launch API (what torchrun and ``accelerate launch`` use themselves).

- ``cluster.launcher=local``: this machine is the whole job (one node, a private rendezvous).
- ``cluster.launcher=torchrun``: this machine is one node of ``cluster.nodes``; the same command
  on every node, the agents meet at ``cluster.rdzv_endpoint`` (c10d) and number the nodes
  themselves; ``cluster.max_restarts`` restarts this node's ranks after a failure.
- inside a SageMaker training container: one node per instance, the rendezvous at SageMaker's
  master host (launchers/sagemaker.py reads its environment).

Under ``torchrun``, ``accelerate launch`` or ``srun`` the environment already says which rank this
process is, and nothing is started here (``launched``).

The ranks run a function, not a second train.py: the validated job is handed over as it is, so
a rank never re-parses the command line (a sweep's command line would start the sweep again,
the trap of re-executing launchers) and never recomposes. On CPU the ranks are forked from this
process, which has imported torch and the engine already (seconds saved per run); on a GPU they
are spawned, since a forked process cannot use CUDA once its parent has.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launchers import sagemaker, slurm

if TYPE_CHECKING:
    from recipes.job import Job

LAUNCHED = ("LOCAL_RANK", "RANK", "WORLD_SIZE")


def launched() -> bool:
    """This process is a rank a launcher started (torchrun, accelerate launch, ours, or a task of
    a multi-task srun step: then torch's variables are exported from Slurm's, see slurm.py)."""
    if slurm.srun_task():
        slurm.export_torch_env()
        return True
    return all(v in os.environ for v in LAUNCHED)


@dataclass(frozen=True)
class Rendezvous:
    nodes: int
    endpoint: str
    run_id: str
    max_restarts: int = 0


def rendezvous(job: Job) -> Rendezvous:
    """Where this node's agent meets the others (validated before launch: launchers.check)."""
    c = job.cluster
    if sagemaker.in_container():
        env = sagemaker.environment()
        return Rendezvous(env.hosts, f"{env.master_addr}:{env.master_port}",
                          f"sagemaker-{env.job_name}", c.max_restarts)
    if c.launcher == "torchrun":
        endpoint = c.rdzv_endpoint or "127.0.0.1:0"
        return Rendezvous(c.nodes, endpoint, f"stratagem-{endpoint}", c.max_restarts)
    return Rendezvous(1, "127.0.0.1:0", uuid.uuid4().hex)


def _rank(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    from backends import run
    from recipes.cli import rank_aware_logging

    rank_aware_logging()
    return run(job, out, plan)


def run_local_ranks(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    """Start this node's ranks, wait for them and return local rank 0's outcome (its ``rank``
    is the global one); a failed rank raises (torch's ChildFailedError names it)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv = rendezvous(job)
    config = LaunchConfig(min_nodes=rdzv.nodes, max_nodes=rdzv.nodes, nproc_per_node=job.world.devices,
                          run_id=rdzv.run_id, rdzv_backend="c10d", rdzv_endpoint=rdzv.endpoint,
                          max_restarts=rdzv.max_restarts, monitor_interval=0.5,
                          start_method="fork" if job.run.accelerator == "cpu" else "spawn")
    outcomes = elastic_launch(config, _rank)(job, out, plan)  # keyed by global rank
    return outcomes[min(outcomes)]
