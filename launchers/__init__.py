"""Launching: how the ranks of a job start. Separate from strategies and backends: a backend
trains one rank; a launcher decides where and how many (``cluster.launcher``).

- ``local``: plain ``python train.py`` with more than one process -- the ranks of this machine
  through torch's elastic launch API (what torchrun uses), each running the job it is handed
  (local.py).
- ``torchrun``: the same on every node of a multi-node job, meeting at ``cluster.rdzv_endpoint``
  (torchrun.py).
- ``slurm``: a Hydra multirun through hydra-submitit-launcher, one Slurm task per rank (slurm.py).
- ``sagemaker``: ``launch.py`` builds the SageMaker job; in the container, one node per instance.
- ``ray``: the ranks as Ray Train workers on ``cluster.ray.address`` (ray.py; Ray imported there only).
- ``k8s``: ``launch.py`` writes and applies a Kubeflow PyTorchJob (k8s.py); in a pod, torchrun.
- already launched (``torchrun``, ``accelerate launch``, ``srun``): this process is a rank.
- ``sweep.py``: a multirun's comparison report.

Each launcher is one module that registers itself (``@launcher(name, ...)``, launchers/registry.py)
plus its conf/cluster YAML: ``check`` and ``run`` here and ``launch.py`` find it there by
``cluster.launcher``, comparing no launcher name.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from launchers import registry, sagemaker, slurm
from launchers.local import RankLost, Stopped, launched, restart_problem, run_local_ranks, stopped

if TYPE_CHECKING:
    from pathlib import Path

    from backends import Outcome
    from recipes.job import Job

__all__ = ["RankLost", "Stopped", "check", "launched", "restart_problem", "run", "run_local_ranks"]


def run(job: Job, out: Path, plan: dict | None = None) -> Outcome:
    """Start this node's ranks (plain ``python train.py`` with several processes), or be the one
    rank this process is. A run stopped on a signal (Ctrl-C, SIGTERM, SIGUSR1: every rank saved)
    raises ``Stopped``, which names the command that resumes; under Slurm, the attempt ends
    without a result for submitit (the requeued attempt writes it)."""
    from backends.common import quiet
    from observers import startup
    from recipes.cli import keep_run_dir

    keep_run_dir()  # (a refusal from here on is the run's: its directory stays)
    startup.mark("checkpoint_load")  # (since the plan: which checkpoint, checked whole; startup)
    quiet.install()  # (this process too: it exports trainer.save_hf after the ranks)
    start = registry.get(job.cluster.launcher).run
    if start is not None and not launched():  # it starts the ranks itself (ray: Ray Train workers)
        return start(job, out, plan)
    if job.mesh.size > 1 and not launched():
        return run_local_ranks(job, out, plan)
    from backends import run as run_rank
    from checkpoints.interrupt import Interrupted

    try:
        return run_rank(job, out, plan)
    except Interrupted as e:
        stop = stopped(e, out, job.trainer.resume_from)  # (names the command that resumes)
        if slurm.in_job():
            slurm.leave_without_result(str(e))
        raise stop from None

def outside_world_problems(nodes: int, devices: int) -> list[str]:
    """Under torchrun or ``accelerate launch``: the job's world against the launcher's (nodes and
    devices follow it unless set: conf/cluster/local.yaml); a mismatch would fail or hang in the
    first collective, so it is one error before any."""
    import os

    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    if world == nodes * devices and local == devices:
        return []
    who = "accelerate launch" if any(k.startswith("ACCELERATE_") for k in os.environ) else "torchrun"
    return [f"{who} started WORLD_SIZE={world} processes, LOCAL_WORLD_SIZE={local} per node, but "
            f"cluster.nodes={nodes} x cluster.devices={devices}: leave cluster.nodes and "
            f"cluster.devices unset (they follow {who}'s environment), or set them to "
            f"cluster.nodes={max(world // max(local, 1), 1)} cluster.devices={local}, or start "
            f"{who} with {devices} process(es) per node on {nodes} node(s)"]


def accelerate_single_cpu_process() -> bool:
    """``accelerate launch --cpu --num_processes N`` (N > 1) without mpirun: its simple launcher
    starts this one process, with MASTER_ADDR set for the others it never starts."""
    import os

    return ("ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ
            and "WORLD_SIZE" not in os.environ)


def check(job: Job) -> list[str]:
    """What the chosen launcher cannot start here (for ``recipes.job.validate(extra=...)``); under
    an outside torchrun that restarts its workers, its rendezvous store's trap (``restart_problem``:
    we set the fix where we start torchrun's agent -- launchers/local.py, the k8s pods -- and
    cannot from inside a worker, so it is refused)."""
    trap = restart_problem() if launched() else None
    return ([trap] if trap else []) + _launch_check(job)


check.world_only = True  # (recipes/job.py asks it beside other problems, once the world is sound)


def refuse_elsewhere(cfg: Any) -> None:
    """Before validation: a launcher whose ranks start elsewhere (a submission step: SageMaker,
    Kubernetes), asked from outside its container or pod, is that one sentence -- this machine's
    GPUs and cores, which validation checks next, are not the run's."""
    from core.errors import ConfigError

    name = str(cfg.cluster.launcher)
    if name not in registry.names() or launched() or sagemaker.in_container():
        return
    chosen = registry.get(name)
    if chosen.submits:  # (its problems read the job's cluster only)
        raise ConfigError(chosen.problems(SimpleNamespace(cluster=cfg.cluster)))


def _launch_check(job: Job) -> list[str]:
    c, size = job.cluster, job.mesh.size
    if sagemaker.in_container():
        return sagemaker.problems(c.nodes, c.devices, job.run.accelerator)
    chosen = registry.get(c.launcher)
    if chosen.checked_first:  # (torchrun: its rendezvous, whoever started this process)
        return chosen.problems(job)
    if slurm.srun_task():
        return slurm.world_problems(size, c.devices)
    if launched():
        return outside_world_problems(c.nodes, c.devices)
    if accelerate_single_cpu_process() and size == 1:
        return ["`accelerate launch` was asked for more than one process but started this one alone "
                "(on CPU it starts several only through mpirun, --mpirun_hostfile), and "
                "cluster.devices=1: set cluster.devices=<N> (this process then starts the N ranks), or "
                "start them with `accelerate launch --multi_gpu --num_processes <N> train.py ...` "
                "(torchrun underneath; it runs on CPU too)"]
    return chosen.problems(job)
