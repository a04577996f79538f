"""Slurm: each Hydra job is a Slurm job with one task per device, submitted by
hydra-submitit-launcher (``python train.py -m hydra/launcher=submitit_slurm cluster=slurm_...``);
srun starts the tasks and every task is one rank.

- ``SlurmSubmission`` (a Hydra callback, conf/hydra/default.yaml) runs before the sweep is
  submitted: it refuses what Slurm would refuse later (a partition that does not exist, more
  ranks per node than a node has CPUs or GPUs, a cluster that is not a Slurm cluster), and fills
  the launcher's request from ``cluster`` -- nodes, one task per device, partition, time,
  account, QOS, constraint, and SIGUSR1 before the time limit -- so the cluster config is the one
  place these are set.
- In the job, ``srun_task`` / ``export_torch_env``: ranks and addresses come from Lightning's
  ``SLURMEnvironment`` (its auto-requeue off: resume has one owner, our checkpoints); torch's
  ``env://`` variables are exported from it for every other engine. On SIGUSR1 every rank stops
  after its step and saves (checkpoints/interrupt.py); ``requeue`` puts the job back in the queue
  and the next attempt resumes from the checkpoint.
- ``client_problems``: sbatch, and an sacct that answers (submitit polls it for every job).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

from launchers.registry import launcher
from recipes.allocation import MB, in_job, partitions  # noqa: F401  (in_job: slurm.in_job() for launchers)

if TYPE_CHECKING:
    from recipes.job import Job

log = logging.getLogger(__name__)
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
"""The directory whose sitecustomize holds SIGUSR1 as a job's processes start."""


def srun_task() -> bool:
    """This process is one task of an srun step with more than one task (the batch script
    itself is no step's task; ``srun -n1`` launches nothing distributed)."""
    return "SLURM_STEP_ID" in os.environ and int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def export_torch_env() -> None:
    """RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT from Lightning's reading
    of Slurm's environment (its port rule, so both agree); what is set already is kept."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = SLURMEnvironment()
    for key, value in (("RANK", env.global_rank()), ("LOCAL_RANK", env.local_rank()),
                       ("WORLD_SIZE", env.world_size()), ("NODE_RANK", env.node_rank()),
                       ("MASTER_ADDR", env.main_address), ("MASTER_PORT", env.main_port)):
        os.environ.setdefault(key, str(value))


def world_problems(size: int, devices: int | None = None) -> list[str]:
    """The srun step against the job's world (a rank of a mismatched step would hang or fail);
    ``devices``: the job's ranks per node, against the step's tasks per node."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    nodes = int(os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    if tasks == size and (devices is None or tasks // nodes == devices):
        return []
    return [f"srun started {tasks} task(s) on {nodes} node(s) but cluster.nodes x cluster.devices = "
            f"{size}{'' if devices is None else f' ({devices} per node)'}: leave cluster.nodes and "
            "cluster.devices unset under srun (they follow its SLURM_* environment), or start one "
            "task per rank (srun --ntasks-per-node=<cluster.devices>)"]


def requeue() -> None:
    """Put this job back in the queue (its next attempt resumes from the checkpoint just saved);
    Slurm then ends this attempt."""
    job = os.environ["SLURM_JOB_ID"]
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    if done.returncode:
        log.error("scontrol requeue %s failed: %s", job, done.stderr.strip())


def stopped_by_slurm(error: BaseException) -> bool:
    """``error`` is how Lightning ends training after Slurm's SIGTERM (a requeue, a preemption,
    a cancel) inside a Slurm job."""
    if "SLURM_JOB_ID" not in os.environ or "lightning" not in sys.modules:
        return False
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    return isinstance(error, SIGTERMException)


def leave_without_result(why: str = "stopped by Slurm (SIGTERM)") -> None:
    """End this attempt of the job with no result for submitit: a requeued job runs again (and
    resumes from the checkpoint saved) and its next attempt writes the result; a cancelled one
    is reported by submitit as cancelled. (Returning would report a result.)"""
    log.warning("%s: this attempt ends without a result; a requeued job resumes from its checkpoint", why)
    logging.shutdown()
    os._exit(143)


# --------------------------------------------------------------------------- before submission
def client_problems() -> list[str]:
    """The Slurm client submitit needs: sbatch to submit, and sacct answering job states (it
    polls sacct; without an accounting database sacct fails and submitit would wait forever)."""
    missing = [c for c in ("sbatch", "sacct", "scontrol") if shutil.which(c) is None]
    if missing:
        return [f"hydra/launcher=submitit_slurm needs the Slurm client on PATH ({', '.join(missing)} "
                "not found): run from a Slurm login node, or install slurm-client"]
    try:
        done = subprocess.run(["sacct", "-n", "-X", "-j", "1", "-o", "JobID"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return [f"sacct did not answer ({e}): submitit reads job states from it"]
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[:1]
        return [f"sacct cannot answer job states here ({said[0] if said else f'exit {done.returncode}'}): "
                "submitit polls sacct for every job and would wait forever. Enable Slurm accounting "
                "(AccountingStorageType=accounting_storage/slurmdbd), or put an sacct that answers "
                "from scontrol on PATH (tests/slurm/bin/sacct is one)"]
    return []


SHAPE = ("cluster", "cluster.nodes", "cluster.devices", "cluster.slurm.cpus_per_task")
"""What decides the allocation: the same for every job of one submission."""


def problems(cfg: DictConfig, task: list[str] | None = None, ask: bool = True) -> list[str]:
    """What Slurm would refuse (or run wrongly) about the composed config, before submission;
    ``task``: the command line's overrides (default: Hydra's, ``cfg.hydra.overrides.task``);
    ``ask``: the partitions too (sinfo: not for ``--dry-run``, which may run anywhere)."""
    c = cfg.cluster
    if c.launcher != "slurm":
        return [f"hydra/launcher=submitit_slurm with cluster.launcher={c.launcher}: each Slurm task "
                "is a rank, so the cluster must say so: use a cluster=slurm_* config (or set "
                "cluster.launcher=slurm)"]
    swept = [o for o in (cfg.hydra.overrides.task if task is None else task)
             if o.split("=")[0].lstrip("+~") in SHAPE and "," in o.partition("=")[2]]
    if swept:
        return [f"{', '.join(swept)}: one Slurm array asks one allocation shape for every job; "
                "sweep cluster shapes as separate multiruns (one per shape)"]
    if not ask:
        return []
    parts = partitions()
    if parts is None:
        log.warning("sinfo is not available here: partition and node sizes are left to Slurm")
        return []
    s, out = c.slurm, []
    name = s.partition
    if name is None:
        default = next((p for p in parts if p.endswith("*")), None)
        name = default.rstrip("*") if default else None
    parts = {k.rstrip("*"): v for k, v in parts.items()}
    if s.partition is not None and s.partition not in parts:
        return [f"cluster.slurm.partition={s.partition!r} is not a partition of this Slurm "
                f"(sinfo: {', '.join(sorted(parts))}): set cluster.slurm.partition to one of them"]
    p = parts.get(name) if name else None
    if p is None:
        return out
    if c.nodes > p["nodes"]:
        out.append(f"cluster.nodes={c.nodes} but partition {name} has {p['nodes']} node(s): "
                   f"set cluster.nodes<={p['nodes']}")
    if s.mem_gb and p.get("memory") and s.mem_gb > p["memory"] * MB:
        out.append(f"cluster.slurm.mem_gb={s.mem_gb} but the smallest node of partition {name} has "
                   f"{p['memory'] * MB:.0f} GB (sinfo): set cluster.slurm.mem_gb<={int(p['memory'] * MB)}, "
                   "or 0 for all of each node's")
    if c.accelerator == "gpu":
        if c.devices > p["gpus"]:
            out.append(f"cluster.devices={c.devices} GPUs per node but the nodes of partition {name} "
                       f"have {p['gpus']}: set cluster.devices<={p['gpus']}")
    elif c.devices * s.cpus_per_task > p["cpus"]:
        out.append(f"cluster.devices={c.devices} ranks x cluster.slurm.cpus_per_task={s.cpus_per_task} "
                   f"CPUs per node but the nodes of partition {name} have {p['cpus']} CPUs: set "
                   f"cluster.devices<={p['cpus'] // s.cpus_per_task}")
    return out


def request(cfg: DictConfig) -> dict[str, Any]:
    """The launcher's keys (hydra-submitit-launcher's SlurmQueueConf) that ``cluster`` decides."""
    c, s = cfg.cluster, cfg.cluster.slurm
    extra: dict[str, Any] = {"requeue": True}
    if s.requeue_signal_s:  # our ranks stop, save and requeue on SIGUSR1 (submitit's own is USR2)
        extra["signal"] = f"USR1@{s.requeue_signal_s}"
    req: dict[str, Any] = {"nodes": c.nodes, "tasks_per_node": c.devices, "cpus_per_task": s.cpus_per_task,
                           "timeout_min": s.time_min, "array_parallelism": s.array_parallelism,
                           "partition": s.partition, "account": s.account, "qos": s.qos,
                           "constraint": s.constraint, "mem_gb": s.mem_gb}
    if c.accelerator == "gpu":
        req["gpus_per_node"] = c.devices
    # every Python process of the job holds SIGUSR1 from its first moment (launchers/site/)
    # (no "${...}": Hydra's config would read it as an interpolation; an empty PYTHONPATH leaves a
    # trailing ":", the working directory, which ``python -m`` puts first anyway)
    site = f"export PYTHONPATH={shlex.quote(SITE)}:$PYTHONPATH"
    return {k: v for k, v in req.items() if v is not None} | {"additional_parameters": extra, "setup": [site]}


class SlurmSubmission(Callback):
    """Before a multirun is submitted through hydra-submitit-launcher's Slurm launcher: check,
    then fill its request from the cluster config. Other launchers: nothing."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not str(config.hydra.launcher.get("_target_", "")).endswith("submitit_launcher.SlurmLauncher"):
            return
        from strategies import ConfigError

        found = client_problems() or problems(config)
        if found:
            log.error("%s", ConfigError(found))
            sys.exit(2)
        # a job that ends without a result is a failed row (hydra_plugins/stratagem/slurm_launcher.py;
        # registered by hand: Hydra's scan of hydra_plugins misses an editable install's packages)
        from hydra.core.plugins import Plugins

        from hydra_plugins.stratagem.slurm_launcher import SlurmLauncher

        Plugins.instance().register(SlurmLauncher)
        with open_dict(config.hydra.launcher):
            config.hydra.launcher._target_ = f"{SlurmLauncher.__module__}.{SlurmLauncher.__name__}"
            for key, value in request(config).items():
                if key == "additional_parameters":
                    value = {**value, **config.hydra.launcher.get("additional_parameters", {})}
                if key == "setup":  # (the user's lines after ours)
                    value = [*value, *(config.hydra.launcher.get("setup") or [])]
                config.hydra.launcher[key] = value
        log.info("slurm: %s", {k: config.hydra.launcher[k] for k in request(config)})


SUBMIT = "python train.py -m hydra/launcher=submitit_slurm"


@launcher("slurm", start=SUBMIT)
def launch_problems(job: Job) -> list[str]:
    """Outside an srun step: its ranks are Slurm tasks, submitted through Hydra's launcher."""
    c, size = job.cluster, job.mesh.size
    if size > 1:
        return [f"cluster.launcher=slurm: each of the {size} ranks is a Slurm task; submit with "
                f"{SUBMIT} cluster={c.name} ... (a sweep of "
                f"one job is fine), or inside an allocation: srun --ntasks-per-node={c.devices} "
                "python train.py ..."]
    return []
