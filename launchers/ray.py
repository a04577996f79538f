"""``cluster.launcher=ray``: the job's ranks as Ray Train workers (``pip install -e ".[ray]"``).

    python train.py cluster=ray cluster.devices=2 strategy=ddp                 # Ray started here
    python train.py cluster=ray cluster.ray.address=<head>:6379 cluster.nodes=2 cluster.devices=8 ...

``run`` connects to the cluster ``cluster.ray.address`` names (None: starts a Ray instance on
this machine for the job, on 127.0.0.1, and stops it after) and fits a ``TorchTrainer`` of
``nodes x devices`` workers (``use_gpu`` on GPUs). Ray sets up the process group (gloo on CPU,
NCCL on GPUs, ``cluster.collective_timeout`` as its timeout) and torch's environment variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``); each worker then
runs ``backends.run`` on the validated job it is handed, unchanged -- as a rank torchrun started
(the backends find the group initialized and join it). The run directory is the driver's (it
must be on a filesystem every Ray node sees, as for any multi-node job): report.json, the
checkpoints and params.pt land where a local run puts them; Ray's own run records go to
``<run>/ray``. Rank 0's ``Outcome`` comes back as the training function's return value.

A failed worker (its process killed, an error) ends ``fit`` with Ray's ``WorkerGroupError``,
whose failures are keyed by rank: ``RankLost`` names the rank that was lost (the others'
failures are their peer vanishing). With ``cluster.max_restarts`` Ray starts the worker group
again that many times (``FailureConfig.max_failures``), and every new worker resolves
``trainer.resume_from=auto`` itself (``checkpoints.start``), so the job continues from the last
complete checkpoint. Ray is imported here only, and only when the job runs.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launchers.registry import launcher
from launchers.torchrun import bad_port

if TYPE_CHECKING:
    from recipes.job import Job

log = logging.getLogger(__name__)

ADDRESS = re.compile(r"^(auto|(ray://)?\[?[A-Za-z0-9_.:-]+\]?:\d{1,5})$")
# What a rank's own error says when a peer is gone (gloo, NCCL, the store): not the cause.
PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "timed out", "Timed out",
             "communicator was aborted", "DistNetworkError", "Connection reset", "Connection closed")


# Ray's words for a worker whose process is gone (killed, crashed, its node lost).
DEAD = ("ActorDiedError", "WorkerHealthCheckFailedError", "ActorUnavailableError", "NodeDiedError")


def problems(cluster: Any) -> list[str]:
    """What stops a Ray launch before anything starts: Ray not installed, a malformed address or
    its port outside 1..65535."""
    out = []
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        out.append("cluster.launcher=ray needs Ray Train, which is not installed: "
                   "pip install -e '.[ray]'")
    address = cluster.ray.address
    if address is None and cluster.nodes > 1:
        out.append(f"cluster.nodes={cluster.nodes} with cluster.ray.address=null: the Ray started for "
                   "the job is this machine alone; set cluster.ray.address=<head>:6379 (a Ray cluster "
                   f"of {cluster.nodes} nodes, `ray start --head` on one, `ray start --address` on the "
                   "others) or cluster.nodes=1")
    if address is not None and not ADDRESS.match(str(address)):
        out.append(f"cluster.ray.address={address!r} is not a Ray address; allowed: null (start Ray "
                   "on this machine for the job), auto (the cluster `ray start` runs here), "
                   "<head>:6379 or ray://<head>:10001: set e.g. cluster.ray.address=10.0.0.1:6379")
    elif address not in (None, "auto") and (port := bad_port("cluster.ray.address", str(address),
                                                                  "10.0.0.1:6379")):
        out.append(port)
    return out


def unreachable(address: str | None, timeout_s: float = 3.0) -> str | None:
    """Why nothing answers at the Ray cluster ``address`` names (a TCP connect, bounded by
    ``timeout_s``), as the sentence refusing it with the fix; None when something listens there
    (Ray's own connection says the rest), for ``auto`` and for null. ``ray.init`` would retry
    for minutes, naming the address Ray rewrote it to."""
    import socket

    if address in (None, "auto"):
        return None
    host, port = str(address).removeprefix("ray://").rsplit(":", 1)
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return None
    except OSError as e:
        timed_out = isinstance(e, TimeoutError)
        why = f"no answer within {timeout_s:g} s" if timed_out else (e.strerror or str(e)).lower()
    return (f"cluster.ray.address={address}: no Ray cluster answers at {host}:{port} ({why}): start "
            "one there with `ray start --head` (it prints the address to give), or set "
            "cluster.ray.address=null to start Ray on this machine for the job")


def _worker(config: dict[str, Any]) -> Any:
    """One rank, inside a Ray Train worker: Ray's process group is up, torch's variables set."""
    os.environ.setdefault("GROUP_RANK", os.environ.get("NODE_RANK", "0"))  # (as torchrun's)
    os.environ.update(config.get("env") or {})  # (the driver's start-up timeline: observers/startup.py)
    root = logging.getLogger()
    if not any(isinstance(h, logging.StreamHandler) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    from backends import run
    from recipes.cli import rank_aware_logging

    rank_aware_logging()
    return run(config["job"], Path(config["out"]), config["plan"])


def _start(job: Job) -> bool:
    """Connect to the cluster, or start a Ray instance here; True when started here."""
    import ray

    address = job.cluster.ray.address
    if ray.is_initialized():
        return False
    if address is None:
        cpus = math.ceil(job.mesh.size * job.cluster.ray.cpus_per_worker)
        ray.init(num_cpus=max(cpus, 1), include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=True)
        return True
    join(address)
    return False


def join(address: str) -> None:
    """``ray.init`` on the cluster at ``address``; Ray's ConnectionError (no cluster for ``auto``;
    after its own retries, something that answers TCP but is not Ray's GCS) as a ConfigError."""
    import ray

    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as e:
        from core.errors import ConfigError

        raise ConfigError(not_ray(address, e)) from None


def not_ray(address: str, error: BaseException) -> str:
    """The sentence for Ray's ``error`` joining the cluster ``address`` names, with the fix."""
    why = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), type(error).__name__)[:300]
    if address == "auto":
        return (f"cluster.ray.address=auto: Ray found no cluster on this machine to join ({why}): "
                "start one with `ray start --head`, or set cluster.ray.address=<head>:6379 (a cluster "
                "elsewhere) or cluster.ray.address=null to start Ray on this machine for the job")
    return (f"cluster.ray.address={address}: something answers there, but no Ray cluster Ray could join "
            f"({why}): give the address `ray start --head` printed on the head (<head>:6379, or "
            "ray://<head>:10001 for Ray Client), not another service's port, or set "
            "cluster.ray.address=null to start Ray on this machine for the job")


def _timeline() -> dict[str, str]:
    """This process's start-up timeline as the environment a rank adopts (``observers.startup``)."""
    from observers import startup

    startup.hand_over()
    try:
        return {startup.ENV: os.environ[startup.ENV]}
    finally:
        startup.take_back()


def run(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    """Fit the job on the Ray cluster; rank 0's ``Outcome``. A lost worker (after
    ``cluster.max_restarts`` restarts) raises ``launchers.RankLost`` naming its rank."""
    if (said := unreachable(job.cluster.ray.address)) is not None:  # (not ray.init's minutes of retries)
        from core.errors import ConfigError

        raise ConfigError(said)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # (prints once, not twice)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from launchers.local import RankLost

    c, gpu = job.cluster, job.run.accelerator == "gpu"
    out = Path(out).resolve()
    started = _start(job)
    env = _timeline() if started else {}  # (one machine, one clock: the workers continue it)
    try:
        trainer = TorchTrainer(
            _worker,
            train_loop_config={"job": job, "out": str(out), "plan": plan, "env": env},
            scaling_config=ScalingConfig(num_workers=job.mesh.size, use_gpu=gpu,
                                         resources_per_worker={"CPU": c.ray.cpus_per_worker,
                                                               **({"GPU": 1} if gpu else {})}),
            torch_config=TorchConfig(backend="nccl" if gpu else "gloo",
                                     timeout_s=math.ceil(c.collective_timeout)),
            run_config=RunConfig(name="stratagem", storage_path=str(out / "ray"),
                                 failure_config=FailureConfig(max_failures=c.max_restarts)),
        )
        log.info("ray: %d worker(s) on %s", job.mesh.size, c.ray.address or "a Ray instance started here")
        try:
            result = trainer.fit()
        except ray.train.TrainingFailedError as e:
            raise RankLost(lost(e, job.mesh.size, c.max_restarts)) from None
        except ray.exceptions.RayError as e:  # Ray's own machinery (the controller, a node) failed
            first = str(e).strip().splitlines()
            raise RankLost(f"the Ray job ended: {type(e).__name__}: "
                           f"{first[0][:300] if first else ''}") from None
        return result.return_value
    finally:
        if started:
            ray.shutdown()


def lost(error: Any, world: int, restarts: int = 0) -> str:
    """Which rank was lost and how, from Ray's failures by rank: a worker that died or failed on
    its own first, not one whose collective saw its peer vanish."""
    failures: dict[int, BaseException] = dict(getattr(error, "worker_failures", None) or {})
    after = f" after {restarts} restart(s)" if restarts else ""
    if not failures:
        first = str(error).strip().splitlines()
        return f"the Ray job failed{after}: {first[-1][:500] if first else type(error).__name__}"

    def text(e: BaseException) -> str:
        return f"{type(e).__name__}: {e}"

    def died(e: BaseException) -> bool:  # (a health check that found the process gone, too)
        return type(e).__name__ in DEAD or "process has died" in str(e) or "actor died" in str(e).lower()

    def kind(item: tuple[int, BaseException]) -> tuple[int, int]:
        rank, e = item
        return (0 if died(e) else 2 if any(p in text(e) for p in PEER_GONE) else 1, rank)

    rank, e = min(failures.items(), key=kind)
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    pid = re.search(r"\bpid[=:]\s*(\d+)", str(e))
    if died(e):
        why = next((ln for ln in lines if "died" in ln or "dead" in ln), lines[0] if lines else "")
        how = (f"its Ray worker process{f' (pid {pid.group(1)})' if pid else ''} died "
               f"({type(e).__name__}: {why.split('. ')[0][:200]})")
    else:
        how = f"it failed: {type(e).__name__}: {lines[-1][:500] if lines else ''}"
    others = sorted(set(failures) - {rank})
    return (f"lost rank {rank} of {world} -- {how}; the job stopped{after}"
            + (f" (ranks {others} were stopped with it)" if others else ""))


@launcher("ray", run=run)
def launch_problems(job: Job) -> list[str]:
    """Ray not installed, a malformed address (``problems``); the ranks are Ray Train workers (``run``)."""
    return problems(job.cluster)
