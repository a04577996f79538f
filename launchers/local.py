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
import signal
import sys
import time
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


MONITOR_SECONDS = 0.5
# What a rank's collective says when a peer is gone (gloo, NCCL, the store).
PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "timed out", "Timed out",
             "communicator was aborted", "DistNetworkError")


def _rank(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    from backends import run
    from checkpoints.interrupt import Interrupted
    from recipes.cli import rank_aware_logging

    rank_aware_logging()
    if job.run.accelerator == "cpu" and job.mesh.devices > 1:  # (forked: the parent's threads)
        import torch

        from strategies.run import cpu_threads

        torch.set_num_threads(cpu_threads(job.mesh.devices))
    try:
        return run(job, out, plan)
    except Interrupted as e:  # every rank saved after the same step: end with the signal's code
        sys.exit(stopped(e))
    except Exception as e:
        # A survivor's collective fails within milliseconds of a peer's death. Torch's agent
        # records one failure per check, the lowest rank among those gone by then; waiting two
        # checks lets it see the rank that died first, so RankLost names the cause (the agent
        # then stops this rank itself).
        if any(p in f"{type(e).__name__}: {e}" for p in PEER_GONE):
            time.sleep(4 * MONITOR_SECONDS)
        raise


def restart_problem() -> str | None:
    """Under torchrun with restarts: the known trap of its shared rendezvous store (a restarted
    worker may read a peer's address from the attempt before and fail to connect,
    pytorch#135712), and its fix; None when it does not apply."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1":
        return (f"torchrun --max-restarts={restarts}: a restarted worker can fail to connect "
                "(torch shares its rendezvous store across attempts, pytorch#135712); start "
                "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")
    return None


class RankLost(RuntimeError):
    """A rank died or failed; the launcher stopped the others."""


class Stopped(RuntimeError):
    """Every rank stopped on a signal after saving its checkpoint (``code``: 128 + the signal)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def stopped(e: Any) -> int:
    """After ``checkpoints.Interrupted`` (every rank saved after the same step): rank 0 says so,
    and under Slurm requeues the job on SIGUSR1 (its time limit is near); the exit code is
    128 + the signal. The requeued or restarted job resumes through trainer.resume_from=auto."""
    import logging
    import signal

    if int(os.environ.get("RANK", "0")) == 0:
        log = logging.getLogger("train")
        if e.signum == signal.SIGUSR1 and slurm.in_job():
            slurm.requeue()
            log.warning("%s; requeued Slurm job %s: the next attempt resumes from it", e,
                        os.environ.get("SLURM_JOB_ID"))
        else:
            log.warning("%s; run the same command again to resume from it (trainer.resume_from=auto)", e)
    return 128 + e.signum


def run_local_ranks(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    """Start this node's ranks, wait for them and return local rank 0's outcome (its ``rank`` is
    the global one). When a rank dies, torch's agent notices within ``monitor_interval`` and
    stops the others (no collective waits for it, no process is left); ``RankLost`` then names
    the rank that was lost."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv = rendezvous(job)
    if rdzv.max_restarts:  # restarted workers must not read the attempt before's peers (pytorch#135712)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(min_nodes=rdzv.nodes, max_nodes=rdzv.nodes, nproc_per_node=job.mesh.devices,
                          run_id=rdzv.run_id, rdzv_backend="c10d", rdzv_endpoint=rdzv.endpoint,
                          max_restarts=rdzv.max_restarts, monitor_interval=MONITOR_SECONDS,
                          start_method="fork" if job.run.accelerator == "cpu" else "spawn")
    from observers import startup

    startup.hand_over()  # the ranks continue this process's start-up timeline
    try:
        outcomes = elastic_launch(config, _rank)(job, out, plan)  # keyed by global rank
        return outcomes[min(outcomes)]
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if len(codes) == 1 and codes <= {128 + signal.SIGUSR1, 128 + signal.SIGTERM}:
            name = signal.Signals(codes.pop() - 128).name
            raise Stopped(f"stopped by {name}: every rank finished its step and saved a checkpoint; "
                          "run the same command again to resume (trainer.resume_from=auto)",
                          128 + signal.Signals[name]) from None
        raise RankLost(_lost(e, job.mesh.size, rdzv.nodes)) from None
    finally:
        startup.take_back()


def _lost(e: Any, world: int, nodes: int = 1) -> str:
    """Which rank was lost and how, from the agent's failures (the ranks the agent itself then
    stopped end by SIGTERM and are not the cause). On one node of several, when every failure
    here is a peer gone, the lost rank is on another node: say that, not this node's own."""

    def message(f: Any) -> str:
        msg = f.message if isinstance(f.message, str) else (f.message or {}).get("message", "")
        return "" if msg in (None, "<NONE>") else str(msg).strip()

    if nodes > 1:
        mine = sorted(e.failures.items())
        if mine and all(f.exitcode > 0 and any(p in message(f) for p in PEER_GONE) for _, f in mine):
            first = message(mine[0][1]).splitlines()[-1][:300]
            return (f"a rank on another node was lost: this node's ranks {[r for r, _ in mine]} of "
                    f"{world} stopped when their peers vanished ({first}); the other node's log "
                    "names the lost rank")

    def how(code: int) -> str:
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    # global rank -> failure (torch records the first it finds; see _rank). A signal the agent
    # did not send (it stops the rest with SIGTERM) first, then errors, then the rest.
    def kind(code: int) -> int:
        return 0 if code < 0 and code != -signal.SIGTERM else 1 if code > 0 else 2

    failures = sorted(e.failures.items(), key=lambda rf: (kind(rf[1].exitcode), rf[1].timestamp))
    rank, first = failures[0]
    detail = ""
    if first.exitcode > 0 and message(first):
        detail = f": {message(first).splitlines()[-1][:500]}"
    others = sorted({r for r, _ in failures} - {rank})
    return (f"lost rank {rank} of {world} (pid {first.pid}) -- it {how(first.exitcode)}{detail}; "
            "the job stopped" + (f" (ranks {others} were stopped with it)" if others else ""))
