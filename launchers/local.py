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

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launchers import sagemaker, slurm, torchrun
from launchers.lost import (PEER_GONE, ROLL, Reaper, Roll, _lost, _quiet_said_errors, _said_error,
                            mismatch_hint)
from launchers.registry import launcher

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
    """Where this node's agent meets the others (validated before launch: launchers.check); a
    ``cluster=torchrun`` job's id is its run directory's (``torchrun.run_id``)."""
    c = job.cluster
    if sagemaker.in_container():
        env = sagemaker.environment()
        return Rendezvous(env.hosts, f"{env.master_addr}:{env.master_port}",
                          f"sagemaker-{env.job_name}", c.max_restarts)
    if c.launcher == "torchrun":
        endpoint = c.rdzv_endpoint or "127.0.0.1:0"
        return Rendezvous(c.nodes, endpoint, torchrun.run_id(torchrun.given_run_dir(job)), c.max_restarts)
    return Rendezvous(1, "127.0.0.1:0", uuid.uuid4().hex)


MONITOR_SECONDS = 0.5


def _rank(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    import checkpoints
    from backends import run
    from checkpoints.interrupt import Interrupted
    from recipes.cli import rank_aware_logging

    # Until the run takes its stop signals (checkpoints/interrupt.py, as the backend starts, before
    # the process group forms): Ctrl-C is the launcher's to pass on (it reached this process
    # group's launcher too), SIGTERM ends this rank at once. Inherited from the launcher otherwise
    # (forked), its handlers would be in force here. A rank that then hangs ignores the agent's
    # SIGTERM: the launcher kills it (launchers/lost.py, Reaper).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    Roll.enter()  # (the launcher names a rank it had to kill)
    checkpoints.interruption().announce = False  # the launcher says what a Ctrl-C does
    checkpoints.interruption().taken = Roll.taken  # (and whether it is saved: _Stops)
    if os.environ.get(STOPPING):  # restarted (cluster.max_restarts) after the launcher was stopped
        sys.exit(128 + int(os.environ[STOPPING]))
    rank_aware_logging()
    if job.run.accelerator == "cpu" and job.mesh.devices > 1:  # (forked: the parent's threads)
        import torch

        from core.run import cpu_threads

        torch.set_num_threads(cpu_threads(job.mesh.devices))
    try:
        return run(job, out, plan)
    except Interrupted as e:  # every rank saved after the same step: end with the signal's code
        sys.exit(stopped(e, out, resume=False).code)  # (the launcher names the checkpoint, how to resume)
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
        return (f"torchrun --max-restarts={restarts}: a restarted worker can fail to connect and the "
                "job hangs (torch shares its rendezvous store across attempts, pytorch#135712), and "
                "a worker cannot change its agent's environment; start torchrun with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                "torchrun ...), or use cluster=torchrun cluster.max_restarts=N, which sets it")
    return None


class RankLost(RuntimeError):
    """A rank died or failed; the launcher stopped the others."""


class Stopped(RuntimeError):
    """Every rank stopped on a signal after saving its checkpoint (``code``: 128 + the signal);
    the message names the checkpoint and the command that resumes from it."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


STOPPING = "STRATAGEM_STOPPING"
"""Set in the launcher's environment (so in ranks started after it) once it is stopped: a rank
the agent restarts then (the stopped ranks' exits count as failures) ends at once."""
STOP_CODES = {128 + signal.SIGUSR1, 128 + signal.SIGTERM, 128 + signal.SIGINT}
"""A rank's exit after ``checkpoints.Interrupted``: every rank saved after the same step."""


def stopped(e: Any, out: Path, resume_from: str | None = "auto", resume: bool = True) -> Stopped:
    """After ``checkpoints.Interrupted`` (every rank saved after the same step): the ``Stopped``
    that ends this process with 128 + the signal, naming the checkpoint and (``resume``) the
    command that resumes from it. Under Slurm, SIGUSR1 (its time limit is near) requeues the job
    instead (rank 0), and the requeued attempt resumes through trainer.resume_from=auto."""
    import logging

    from launchers import resume as resuming

    rank0 = int(os.environ.get("RANK", "0")) == 0
    if e.signum == signal.SIGUSR1 and slurm.in_job():
        if rank0:
            slurm.requeue()
            logging.getLogger("train").warning(
                "%s; requeued Slurm job %s: the next attempt resumes from it", e,
                os.environ.get("SLURM_JOB_ID"))
        return Stopped(str(e), 128 + e.signum)
    how = f"; to resume: {resuming.command(out, resume_from)}" if resume and rank0 else ""
    return Stopped(f"{e}{how}", 128 + e.signum)


class _Stops:
    """SIGINT and SIGTERM in the process that started the ranks, while they run. The agent's own
    handlers are left out (``signals_to_handle``): on SIGINT it would pass a second SIGINT on to
    ranks that got the terminal's Ctrl-C already -- a second Ctrl-C for them, which stops at
    once -- and on SIGTERM it would kill ranks still saving after 30 s.

    The first signal: the ranks are sent SIGTERM (they may not have had the signal: ``kill -INT``
    of this process alone; a rank already stopping ignores it), each finishes its step, they save
    together and exit (``_rank``); the agent then reports them. They have ``bound_s``
    (cluster.collective_timeout) for it, then they are killed. A second Ctrl-C kills them at once,
    and so does the first when no rank runs yet (a rendezvous still waiting for other nodes).
    This process ends with 128 + the first signal either way."""

    def __init__(self, out: Path, job: Job, roll: Roll):
        from checkpoints.interrupt import SAME_PRESS_S

        self.out, self.job, self.bound_s = out, job, float(job.cluster.collective_timeout)
        self.roll = roll
        self.window = SAME_PRESS_S
        self.signum = 0
        self._presses, self._first, self._pid, self._before = 0, 0.0, 0, {}

    def __enter__(self) -> _Stops:
        self._pid = os.getpid()
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM):
            self._before[s] = signal.getsignal(s)
        signal.signal(signal.SIGINT, self._signal)
        signal.signal(signal.SIGTERM, self._signal)
        signal.signal(signal.SIGALRM, self._too_long)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.environ.pop(STOPPING, None)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in self._before.items():
            signal.signal(s, handler)

    def _signal(self, signum: int, frame: Any) -> None:
        from checkpoints.interrupt import say

        if os.getpid() != self._pid:  # a rank forked before it set its own (_rank, first thing)
            if signum == signal.SIGTERM:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            return
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._presses and now - self._first < self.window:
                return  # the same Ctrl-C, passed on
            self._presses += 1
            if self._presses > 1:
                self._end("Ctrl-C again: stopped every rank at once, without a checkpoint of this step")
            self._first = now
        if self.signum:
            return
        self.signum = signum
        os.environ[STOPPING] = str(signum)
        if not self._send(signal.SIGTERM):  # (still meeting the other nodes, or all done)
            self._end(f"stopped by {_signal_name(signum)}: no rank was running")
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if not self.roll.all_taken(self.job.mesh.devices):  # (a rank still starting ends at once)
            say(f"{what}: the ranks are still starting, before their first step: the run stops now, "
                "without a checkpoint")
        else:
            say(f"{what}: every rank finishes its step and saves a checkpoint, then the run stops (within "
                f"{self.bound_s:g} s, cluster.collective_timeout)" +
                ("; Ctrl-C again to stop at once, without one" if signum == signal.SIGINT else ""))
        signal.setitimer(signal.ITIMER_REAL, self.bound_s)

    def quiet(self, record: logging.LogRecord) -> bool:
        """A filter for torch's agent log: not its record (with a traceback) of a rank ended by the
        SIGTERM or SIGKILL this process sent it on a stop; the last line says how the run ended."""
        args = record.args if isinstance(record.args, tuple) else ()
        return not (self.signum and str(record.msg).startswith("failed (exitcode")
                    and args and args[0] in (-signal.SIGTERM, -signal.SIGKILL))

    def _too_long(self, signum: int, frame: Any) -> None:
        self._end(f"the ranks did not stop within {self.bound_s:g} s (cluster.collective_timeout) of "
                  f"the {signal.Signals(self.signum).name}: stopped them")

    def _send(self, signum: int) -> int:
        """Signal the ranks (torch starts them as multiprocessing's children); how many."""
        import multiprocessing

        sent = 0
        for p in multiprocessing.active_children():
            try:
                os.kill(p.pid, signum)
                sent += 1
            except ProcessLookupError:
                pass
        return sent

    def _end(self, why: str) -> None:
        from checkpoints.interrupt import exit_now, say

        self._send(signal.SIGKILL)
        say(f"{why}; {newest(self.out, self.job)}")
        exit_now(128 + (self.signum or signal.SIGINT))

    def outcome(self, codes: set[int]) -> Stopped:
        """How the run ended after this process's signal (the ranks' exit codes: ``STOP_CODES``
        when they saved together; a rank still starting when it came ends without saving)."""
        if len(codes) == 1 and codes <= STOP_CODES:
            return Stopped(_saved(self.signum, self.out, self.job), 128 + self.signum)
        return Stopped(f"stopped by {_signal_name(self.signum)} before the ranks saved a checkpoint of "
                       f"this step; {newest(self.out, self.job)}", 128 + self.signum)


def _signal_name(signum: int) -> str:
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


def _step(ckpt: Path) -> int:
    return int(ckpt.name.removeprefix("step"))


def _command(out: Path, job: Job) -> str:
    from launchers import resume

    return resume.command(out, job.trainer.resume_from)


def newest(out: Path, job: Job) -> str:
    """The newest complete checkpoint of the run in ``out`` and the command that resumes from it."""
    from checkpoints.store import latest

    ckpt = latest(out)
    if ckpt is None:
        return "no checkpoint was saved: the same command starts the run over"
    return f"the newest checkpoint is {ckpt} (step {_step(ckpt)}); to resume from it: {_command(out, job)}"


def _agent_options() -> dict[str, Any]:
    """LaunchConfig's options for signals, where this torch has them (2.9+; asked of the class,
    not of the version): the agent handles neither SIGINT nor SIGTERM (``_Stops`` does). An older
    agent takes both over as it starts the ranks: it passes the signal on, kills the ranks 30 s
    later and raises ``SignalException``; a rank counts the Ctrl-C it passes on as the terminal's
    (checkpoints/interrupt.py, SAME_PRESS_S)."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    return {"signals_to_handle": "SIGHUP,SIGQUIT"} if "signals_to_handle" in names else {}


def run_local_ranks(job: Job, out: Path, plan: dict[str, Any] | None) -> Any:
    """Start this node's ranks, wait for them and return local rank 0's outcome (its ``rank`` is
    the global one). When a rank dies, torch's agent notices within ``monitor_interval`` and
    stops the others (no collective waits for it, no process is left); ``RankLost`` then names
    the rank that was lost. Ctrl-C or SIGTERM here: every rank finishes its step and saves,
    and ``Stopped`` names the checkpoint and the command that resumes (``_Stops``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv = rendezvous(job)
    if rdzv.max_restarts:  # restarted workers must not read the attempt before's peers (pytorch#135712)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config = LaunchConfig(min_nodes=rdzv.nodes, max_nodes=rdzv.nodes, nproc_per_node=job.mesh.devices,
                          run_id=rdzv.run_id, rdzv_backend="c10d", rdzv_endpoint=rdzv.endpoint,
                          max_restarts=rdzv.max_restarts, monitor_interval=MONITOR_SECONDS,
                          start_method="fork" if job.run.accelerator == "cpu" else "spawn",
                          **_agent_options())
    from torch.distributed.elastic.multiprocessing import SignalException

    from observers import startup

    startup.hand_over()  # the ranks continue this process's start-up timeline
    roll = Roll(Path(tempfile.mkdtemp(prefix="stratagem-ranks-")))
    os.environ[ROLL] = str(roll.path)
    stops = _Stops(out, job, roll)
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(_quiet_said_errors)
    agent_log.addFilter(stops.quiet)
    reaper, spawn_log = Reaper(lambda: bool(stops.signum)), logging.getLogger("torch.multiprocessing.spawn")
    spawn_log.addFilter(reaper)
    try:
        with stops:
            outcomes = elastic_launch(config, _rank)(job, out, plan)  # keyed by global rank
        return outcomes[min(outcomes)]
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if stops.signum:  # this process was signalled (Ctrl-C, SIGTERM)
            raise stops.outcome(codes) from None
        if len(codes) == 1 and codes <= STOP_CODES:  # a rank was signalled: all saved together
            signum = codes.pop() - 128
            raise Stopped(_saved(signum, out, job), 128 + signum) from None
        said = _said_error(e)  # (a bad record, a run directory not shared: exit 2; a full disk: 1)
        stuck = roll.ranks(reaper.killed)  # (else the ranks the agent's SIGTERM ended: stuck early)
        ended = {} if stuck else roll.ranks(reaper.ended - {f.pid for f in e.failures.values()})
        hint = mismatch_hint(e) if job.run.checkpoint == "deepspeed" else ""  # (a ZeRO preset)
        raise (said or RankLost(_lost(e, job.mesh.size, rdzv.nodes, stuck, ended) + hint)) from None
    except SignalException as e:  # an agent that handles signals itself passed it on and waited
        raise Stopped(f"stopped by {_signal_name(e.sigval)}; {newest(out, job)}", 128 + e.sigval) from None
    finally:
        agent_log.removeFilter(_quiet_said_errors)
        agent_log.removeFilter(stops.quiet)
        spawn_log.removeFilter(reaper)
        os.environ.pop(ROLL, None)
        shutil.rmtree(roll.path, ignore_errors=True)
        startup.take_back()


def _saved(signum: int, out: Path, job: Job) -> str:
    """The ranks stopped on ``signum`` after saving together: the newest checkpoint is theirs."""
    from checkpoints.store import latest

    ckpt = latest(out)
    if ckpt is None:  # (a save that failed ends a rank otherwise)
        return f"stopped by {_signal_name(signum)}; {newest(out, job)}"
    return (f"stopped by {_signal_name(signum)} after step {_step(ckpt)}: every rank finished its step and "
            f"saved a checkpoint ({ckpt}); to resume: {_command(out, job)}")


@launcher("local")
def launch_problems(job: Job) -> list[str]:
    """Plain ``python train.py`` starts the ranks of this one machine (run: ``run_local_ranks``,
    the registry's default)."""
    c = job.cluster
    if c.nodes > 1:
        return [f"cluster.nodes={c.nodes}: plain `python train.py` starts the ranks of one machine; "
                f"start every node with cluster=torchrun cluster.nodes={c.nodes} "
                "cluster.rdzv_endpoint=<node 0>:29500 (one command per node), or with torchrun "
                f"--nnodes {c.nodes} ... train.py ..., or through Slurm or SageMaker"]
    return []
