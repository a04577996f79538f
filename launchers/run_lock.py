"""One job per run directory: the job that starts in a run directory (or a sweep directory) holds
it until it ends; a second job there exits 2 naming the holder, before it writes a file there.

The first thing train.py does with its run directory (the Hydra callback ``RunLock``, beside
``recipes.cli.OutputDirectory`` in conf/hydra/default.yaml: before Hydra writes ``.hydra/`` and
the log there, before any process group or engine starts) is ``hold(directory)``:

- an exclusive ``fcntl.flock`` on ``<dir>/.lock``, held by the open file until the process ends:
  the kernel (or the file server) drops it when the process dies, so a crashed or killed job
  never leaves a stale lock and nothing has to be cleaned up;
- ``<dir>/.owner.json`` (written atomically: a temp file, then a rename) with the job's id
  (``job_id``), host, pid and start time, which the refusal quotes.

A process that finds the lock held reads the owner: the same job id is a process of the same
job (another srun task or torchrun rank, another node of it, a requeued attempt while the file
server still holds a dead node's lock) and goes on without holding it; another id is refused.
A requeued or restarted job (Slurm requeue, a torchrun or Kubernetes restart, the resume command
a stopped run prints) starts after the processes before it ended, so the lock is free then.

File systems (flock across nodes): local disks, NFS v3/v4 (the Linux client turns flock into a
whole-file POSIX lock the server keeps; a mount with ``nolock`` or ``local_lock=all`` keeps it
on the node), Lustre mounted with ``-o flock`` (FSx for Lustre's documented mount;
``localflock`` locks per node only), GPFS / Spectrum Scale, CephFS and EFS lock cluster-wide;
BeeGFS without ``tuneUseGlobalFileLocks`` locks per node. Where the lock is per node, two jobs
on different nodes are not seen; where flock fails (Lustre ``noflock``: ENOSYS; some FUSE
mounts), the job logs one warning and goes on unlocked.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

LOCK, OWNER = ".lock", ".owner.json"
SETTLE_S = 0.2
"""A holder writes its owner file right after it takes the lock; one who finds the lock taken
reads the owner after this long (a new holder's file, not the one before it)."""
JOB_ID = "STRATAGEM_JOB_ID"
"""The job's id when set (the Kubernetes pods get it from launch.py; any other launcher's
processes may be given one); otherwise ``job_id`` asks the environment."""
_held: dict[Path, Any] = {}  # resolved directory -> the open lock file (this process holds it)


@dataclass(frozen=True)
class Owner:
    job: str  # the job's id: equal for every process of one job, and for its requeues
    host: str
    pid: int
    started: str

    def __str__(self) -> str:
        return f"job {self.job} (host {self.host}, pid {self.pid}, since {self.started})"


class RunDirectoryBusy(RuntimeError):
    """Another job holds the run directory."""

    def __init__(self, directory: Path, owner: Owner | None, key: str = "hydra.run.dir"):
        holder = str(owner) if owner else f"a job whose owner file ({directory / OWNER}) is not readable"
        super().__init__(
            f"run directory {directory} is in use by {holder}: two jobs in one run directory overwrite "
            f"each other's checkpoints and report.json. Give this run another directory ({key}=<new "
            f"directory>, or leave {key} unset for a new one), or wait until that job ends (its "
            "requeue or restart, and the resume command a stopped run prints, are let in)")
        self.directory, self.owner = directory, owner


def _started(pid: int) -> str:
    """When process ``pid`` started (from /proc; now where there is none), ISO seconds."""
    from recipes.compose import process_started

    when = process_started(pid) or time.time()
    return datetime.datetime.fromtimestamp(when).isoformat(timespec="seconds")


def _torchrun_id(env: Any) -> str | None:
    """Under torchrun (or ``accelerate launch``): its run id, or (the default id ``none``) the
    rendezvous store every rank of the attempt meets at."""
    run = env.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return None
    if run not in ("", "none"):
        return f"torchrun:{run}"
    addr = env.get("MASTER_ADDR", "")
    if addr in ("", "localhost", "127.0.0.1", "::1"):
        addr = socket.gethostname()
    return f"torchrun:{addr}:{env.get('MASTER_PORT', '')}"


def job_id(env: Any = None, rendezvous: str | None = None) -> str:
    """This process's job: ``STRATAGEM_JOB_ID``; Slurm's job id (with the srun step's); the
    SageMaker training job's name; torchrun's run id; the ``rendezvous`` every node of a
    ``cluster=torchrun`` job meets at (``cluster.rdzv_endpoint``); else this process (host, pid,
    start)."""
    env = os.environ if env is None else env
    if env.get(JOB_ID):
        return env[JOB_ID]
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID")
        return f"slurm:{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    if "SM_CURRENT_HOST" in env and "SM_HOSTS" in env:
        return f"sagemaker:{env.get('TRAINING_JOB_NAME', 'job')}"
    if _torchrun_id(env):
        return _torchrun_id(env)
    if rendezvous:
        return f"torchrun:{rendezvous}"
    return f"process:{socket.gethostname()}:{os.getpid()}:{_started(os.getpid())}"


def owner(directory: str | Path) -> Owner | None:
    """The owner file's record (the holder's, or the last one's once it ended); None: none."""
    try:
        return Owner(**json.loads((Path(directory) / OWNER).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write_owner(directory: Path, me: Owner) -> None:
    """The owner file names ``me``; if it cannot be written (a full disk), neither the temporary
    file nor the last holder's record stays (a refusal would quote a job that ended)."""
    tmp = directory / f"{OWNER}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(me.__dict__, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / OWNER)
    except OSError:
        for stale in (tmp, directory / OWNER):
            with contextlib.suppress(OSError):
                stale.unlink(missing_ok=True)
        raise


def hold(directory: str | Path, key: str = "hydra.run.dir", job: str | None = None) -> bool:
    """Hold ``directory`` for this job until this process ends (or ``release``). True: this
    process holds it (or did already); False: a process of the same job does, or this file
    system cannot lock (warned). Raises ``RunDirectoryBusy`` when another job holds it."""
    import fcntl

    path = Path(directory).resolve()
    if path in _held:
        return True
    path.mkdir(parents=True, exist_ok=True)
    me = Owner(job or job_id(), socket.gethostname(), os.getpid(), _started(os.getpid()))
    try:  # (opened for writing: NFS grants an exclusive lock only to a writer)
        f = open(path / LOCK, "a+")  # noqa: SIM115  (open until the process ends: that is the lock)
    except OSError as e:  # (another user's lock file)
        return _unlocked(path, e)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.close()
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return _unlocked(path, e)
        time.sleep(SETTLE_S)
        holder = owner(path)
        if holder is not None and holder.job == me.job:
            return False
        raise RunDirectoryBusy(path, holder, key) from None
    _held[path] = f
    try:
        _write_owner(path, me)
    except OSError as e:  # (a full disk: held, but a refused job cannot name this one)
        print(f"warning: cannot write {path / OWNER} ({e})", file=sys.stderr)
    return True


def _unlocked(path: Path, e: OSError) -> bool:
    print(f"warning: cannot lock run directory {path} ({e}): another job could write into it "
          "unnoticed (launchers/run_lock.py says which file systems lock)", file=sys.stderr)
    return False


def release(directory: str | Path) -> None:
    """Let go of a directory this process holds (a sweep's, after it; tests)."""
    f = _held.pop(Path(directory).resolve(), None)
    if f is not None:
        f.close()


class RunLock(Callback):
    """Hydra callback (conf/hydra/default.yaml, after OutputDirectory): the run directory (a
    multirun: the sweep directory) is this job's, or one line naming its owner and exit 2."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._hold(config, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._hold(config, "hydra.sweep.dir")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        directory = _select(config, "hydra.sweep.dir")
        if directory is not None:
            release(directory)

    @staticmethod
    def _hold(config: Any, key: str) -> None:
        from recipes.cli import CONFIG_ERROR

        directory = _select(config, key)
        if directory is None:
            return
        multinode = _select(config, "cluster.launcher") == "torchrun"  # (one command per node)
        try:
            hold(directory, key, job_id(rendezvous=_select(config, "cluster.rdzv_endpoint") if multinode else None))
        except RunDirectoryBusy as e:
            if int(os.environ.get("RANK") or 0) == 0:
                print(f"error: {e}", file=sys.stderr)
            sys.exit(CONFIG_ERROR)


def _select(config: Any, key: str) -> str | None:
    from omegaconf import OmegaConf

    try:
        directory = OmegaConf.select(config, key, throw_on_resolution_failure=True)
    except Exception:  # noqa: BLE001  (Hydra resolves it itself next, and says what is wrong)
        return None
    return None if directory is None else str(directory)
