"""Checkpoints, the same for every backend and strategy: what one holds (``state``), where it lives
and when it counts (``store``), and the three calls a backend makes -- ``resolve`` (which
checkpoint ``trainer.resume_from`` means, checked before any process starts), ``save`` and
``load`` (every rank, with the engine's objects in ``Handles``).

    <run dir>/checkpoints/step<N>/
        COMPLETE         the manifest (every file and its size), written last
        meta.json        step (the data position), world size, strategy, backend, payload kind,
                         LR scheduler state, the model's parameter shapes, the resolved config
        config.yaml      the resolved config, for people
        history.json     the run's record so far (losses, validations): a resumed run reports
                         the whole run, from step 1
        dcp/ | deepspeed/  model + optimizer, as torch DCP or DeepSpeed wrote them
        rng/rank<r>.pt   each rank's RNG states
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpoints import hosts
from checkpoints.store import Checkpoint, CheckpointError, clean, latest, read

if TYPE_CHECKING:
    from checkpoints.state import Handles
    from recipes.config import ModelConfig
    from recipes.job import Job

__all__ = ["AUTO", "Checkpoint", "CheckpointError", "Finished", "Handles", "checked", "disk_full", "due",
           "Interrupt", "Interrupted", "for_launch", "interruption", "load", "resolve", "resume_line",
           "resuming", "save", "shapes", "start", "verify", "write_error"]

log = logging.getLogger(__name__)
AUTO = "auto"


class Finished(Exception):
    """The checkpoint to resume is at (or past) ``trainer.max_steps``: nothing is left to run."""


def __getattr__(name: str) -> Any:
    if name == "Handles":  # torch-free import of the package; Handles lives with the torch code
        from checkpoints.state import Handles

        return Handles
    if name in ("Interrupt", "Interrupted", "interruption"):
        from checkpoints import interrupt

        return interrupt.current if name == "interruption" else getattr(interrupt, name)
    raise AttributeError(name)


def shapes(model: ModelConfig) -> dict[str, list[int]]:
    """The plain model's parameter names and shapes under ``model`` (built on the meta device)."""
    import torch

    from recipes import training

    with torch.device("meta"):
        built = training.build_model(model, 0, meta=True)
    return {k: list(v.shape) for k, v in built.state_dict().items()}


def resolve(resume_from: str | None, run_dir: str | Path, model: ModelConfig | None = None, *,
            cleanup: bool = True) -> Checkpoint | None:
    """The checkpoint ``trainer.resume_from`` names, checked whole: ``auto`` -> the newest complete
    one in ``run_dir`` (None: start fresh), a path -> that one, None -> none. ``cleanup``: remove
    what interrupted saves left in ``run_dir`` (one process does it: rank 0 or the launcher).
    ``model``: also ``verify`` it whole against that model. Raises ``CheckpointError`` naming the
    file, or the parameter whose shape differs."""
    if resume_from is None:
        return None
    if resume_from == AUTO:
        if cleanup:
            for p in clean(run_dir):
                log.warning("removed an interrupted checkpoint save: %s", p)
        found = latest(run_dir) if not hosts.declared() else _whole(run_dir)
        if found is None:
            return None
        ckpt = read(found)
    else:
        ckpt = read(resume_from)
    if model is not None:
        verify(ckpt, model)
    return ckpt


def verify(ckpt: Checkpoint, model: ModelConfig) -> None:
    """Before launch, once: the parameter shapes against ``model``'s, and every file read safely
    (torch's: the meta-device build, DCP's metadata, the RNG files)."""
    from checkpoints import state

    _check_shapes(ckpt, shapes(model))
    state.verify(ckpt)


def _whole(run_dir: str | Path) -> Path | None:
    """Per-host run directories (checkpoints/hosts.py): the newest checkpoint whose union arrived."""
    from checkpoints.store import latest_whole

    found, skipped = latest_whole(run_dir)
    for why in skipped:
        log.warning("not resuming from a checkpoint a host's files never reached: %s", why)
    return found


def checked(job: Job, run_dir: str | Path | None = None, *, cleanup: bool = False, files: bool = True
            ) -> Checkpoint | None:
    """The checkpoint ``trainer.resume_from`` names, checked whole (whether this preset and model
    continue from it: ``refusal``, first, so a model key's line names the key, not a parameter's
    shape; then every file and the model's shapes: ``verify``; a path not past
    ``trainer.max_steps``), or one ConfigError: train.py's check (``for_launch``), ``--dry-run``'s
    and a sweep preflight's (``run_dir`` None: no run directory yet, ``auto`` not looked for).
    ``files`` False: what meta.json says only, without torch (plan.py)."""
    from strategies import ConfigError

    resume_from = job.trainer.resume_from
    if resume_from is None or (resume_from == AUTO and run_dir is None):
        return None
    try:
        ckpt = resolve(resume_from, run_dir, cleanup=cleanup)
        why = ckpt and refusal(ckpt, job)
        if ckpt and not why and files:
            verify(ckpt, job.model)
    except CheckpointError as e:
        raise ConfigError(f"trainer.resume_from={resume_from}: {e}; point trainer.resume_from at "
                          "another checkpoint, or null to start fresh") from None
    if why:
        raise ConfigError(f"trainer.resume_from={resume_from}: {why}")
    if resume_from != AUTO and ckpt.step > job.trainer.max_steps:
        raise ConfigError(f"trainer.resume_from={resume_from} is at step {ckpt.step}, past trainer.max_steps="
                          f"{job.trainer.max_steps}: set trainer.max_steps above {ckpt.step} to continue it "
                          f"(={ckpt.step} only loads it), or resume an earlier checkpoint")
    return ckpt


def for_launch(job: Job, run_dir: str | Path, *, cleanup: bool) -> Job:
    """The checkpoint ``trainer.resume_from`` means, ``checked`` before any process starts. A path
    stays that path; ``auto`` stays ``auto``, so a restarted worker finds the newest checkpoint
    again (its ranks agree on it: ``start``). ``cleanup``: this process (the launcher, or rank 0
    under torchrun) removes what interrupted saves left and, as the run will train, sets an
    earlier attempt's report.json and plots aside (``observers.report.set_aside``), and the
    checkpoints of another timeline, then prunes to ``trainer.keep_last`` (``timeline.at_start``). Raises
    ``Finished`` when ``auto`` finds a checkpoint at ``trainer.max_steps`` (a re-run, a requeue:
    its report stands); a path at it only loads (said)."""
    import dataclasses

    resume_from = job.trainer.resume_from
    ckpt = checked(job, run_dir, cleanup=cleanup)
    if resume_from == AUTO and ckpt is not None and ckpt.step >= job.trainer.max_steps:
        raise Finished(f"already finished at step {ckpt.step} ({ckpt.path}); raise "
                       f"trainer.max_steps (now {job.trainer.max_steps}) to continue")
    if resume_from == AUTO and ckpt is not None and stopped_early(ckpt, job.trainer):
        raise Finished(f"already stopped early at step {ckpt.step} ({ckpt.path}, trainer."
                       "early_stopping); raise trainer.early_stopping.patience, or set it to 0, "
                       "to continue")
    if cleanup:  # training starts here: an earlier attempt's report is not this attempt's
        from observers.report import set_aside

        set_aside(run_dir)
    if ckpt is not None:  # (and --dry-run's notes: the same lines)
        from checkpoints.resume_settings import notes

        log.info("%s", resume_line(ckpt, job))
        for line in notes(ckpt, job):  # (the batch, data stream, model settings, schedule that differ)
            log.warning("%s", line)
    if cleanup:  # (another timeline's checkpoints aside; pruned to trainer.keep_last now)
        from checkpoints import timeline

        timeline.at_start(job, ckpt, run_dir)
    if resume_from == AUTO:
        return job
    trainer = dataclasses.replace(job.trainer, resume_from=str(ckpt.path) if ckpt else None)
    return dataclasses.replace(job, trainer=trainer)


def resume_line(ckpt: Checkpoint, job: Job) -> str:
    """The checkpoint a launch resumes, and, where its optimizer state does not load
    (resume_settings.py ``model_only``), that the model loads alone and why: train.py's log line
    and ``--dry-run``'s."""
    from checkpoints.resume_settings import model_only

    m = ckpt.meta
    line = (f"resume: {ckpt.path} (step {ckpt.step}, {m.get('strategy_option') or m['strategy']} on "
            f"{m['world_size']} rank(s))")
    why = model_only(m, job)
    return line if why is None else f"{line}; the model only: {why}; the optimizer state starts fresh"


def refusal(ckpt: Checkpoint, job: Job) -> str | None:
    """Why ``job`` cannot continue from ``ckpt``, before launch; None when it can. A DeepSpeed
    engine loads its own checkpoints of the same world size and backend whole, any other's model
    (its optimizer starts fresh), zero2_ep only its own; torch presets load anything, except
    those that keep state of their own on each rank (``resume_problem``: ddp's PowerSGD, top-k,
    int8, local SGD, DiLoCo), which resume from their own checkpoints on as many ranks. Where the
    optimizer state loads, what shapes it is the checkpoint's (resume_settings.py ``optimizer_refusal``).
    The model must be the checkpoint's (``model_refusal``: its keys, by name, before the shapes are compared)."""
    from checkpoints.resume_settings import dpo_refusal, model_refusal, optimizer_refusal

    why = getattr(job.strategy, "resume_problem", lambda _: None)(job.strategy_option)
    if why and not _holds_rank_state(ckpt, job):
        return why
    if why := dpo_refusal(ckpt, job) or optimizer_refusal(ckpt, job) or _zero_ep_refusal(ckpt, job):
        return why
    saved = (ckpt.meta.get("config") or {}).get("model")
    return model_refusal(saved, job.model) if isinstance(saved, dict) else None


def _zero_ep_refusal(ckpt: Checkpoint, job: Job) -> str | None:
    """zero2_ep resumes only from its own checkpoints of the same world size and backend (a ZeRO
    run takes any other's model, the optimizer fresh)."""
    m = ckpt.meta
    if job.run.checkpoint != "zero_ep" or (m["payload"], int(m["world_size"]), m["backend"]) == (
            job.run.checkpoint, job.mesh.size, job.backend):
        return None
    return (f"{ckpt.path} was written by {m['strategy']} on {m['world_size']} rank(s) with "
            f"backend={m['backend']}; strategy={job.strategy.name} (experts split over ranks) "
            f"resumes only from its own checkpoints of the same world size and backend: resume "
            f"with strategy={m['strategy']} cluster.devices={m['world_size']} backend={m['backend']}, "
            "or a torch preset (single, ddp, fsdp, fsdp2)")


def _holds_rank_state(ckpt: Checkpoint, job: Job) -> bool:
    """``ckpt`` holds every rank's own state for ``job``: written on as many ranks by a preset of its
    family with the same keys that make that state (``rank_state``: the comm hook and its keys, the
    sync settings -- not the name, which two user presets over ddp share; checkpoints/store.py
    ``RANK_STATE``): a look at meta.json and the directory, no torch."""
    from checkpoints.store import RANK_STATE

    m, s = ckpt.meta, job.strategy
    saved = (m.get("config") or {}).get("strategy") or {}
    same = (m.get("family", s.family) == s.family and all(saved.get(k) == v for k, v in s.rank_state().items())
            if saved else m.get("strategy") == s.name)  # (a meta.json without the config: by name)
    return same and int(m.get("world_size", 0)) == job.mesh.size and all(
        (ckpt.path / RANK_STATE / f"rank{r}.pt").is_file() for r in range(job.mesh.size))


def _check_shapes(ckpt: Checkpoint, want: dict[str, list[int]]) -> None:
    have = {k: list(v) for k, v in ckpt.meta.get("shapes", {}).items()}
    for key in sorted(set(have) | set(want)):
        if key not in want:
            raise CheckpointError(f"{ckpt.path}: parameter {key!r} is in the checkpoint but not in "
                                  "the model this config builds (a different model.* shape?)")
        if key not in have:
            raise CheckpointError(f"{ckpt.path}: parameter {key!r} of the model this config builds "
                                  "is missing from the checkpoint (a different model.* shape?)")
        if have[key] != want[key]:
            raise CheckpointError(f"{ckpt.path}: parameter {key!r} has shape {have[key]} in the "
                                  f"checkpoint but {want[key]} in the model this config builds: "
                                  "resume with the model.* settings it was trained with")


def due(trainer: Any, step: int, decision: Any = None) -> bool:
    """Whether the checkpoint of optimizer step ``step`` is to be saved: every
    ``trainer.checkpoint_every`` steps, the final one (``trainer.save_last``: the last step, or
    the step an early stop ends the run at), and a new best (``decision``: the validator's,
    recipes/stopping.py)."""
    every = trainer.checkpoint_every
    stop, keep = (decision.stop, decision.keep) if decision is not None else (False, False)
    return (bool(every and step % every == 0) or keep
            or (trainer.save_last and (step == trainer.max_steps or stop)))


def save(h: Handles, job: Job, run_dir: str | Path, step: int, history: dict[str, Any] | None = None
         ) -> Path:
    """Every rank, collectively: write the checkpoint of ``step`` under a temporary name; rank 0
    then marks it complete and renames it, and prunes to ``trainer.keep_last``. ``history``: the
    run's record so far (``Observers.history``), which a resumed run continues. A write that fails
    (a full disk, a read-only one) is one ``OSError`` with its errno: what failed, on which ranks,
    the fix (``write_error``) -- not torch DCP's nest of per-rank tracebacks."""
    import os

    from checkpoints import store

    temp, final = store.temp_for(run_dir, step), store.path_for(run_dir, step)
    try:
        return _save(h, job, run_dir, step, history, temp, final)
    except BaseException as e:  # (torch DCP's CheckpointException is a BaseException)
        if (cause := write_error(e, temp)) is None:
            raise
        raise OSError(cause.errno, f"{os.strerror(cause.errno)}: saving the checkpoint of step {step} into {temp} "
                      f"failed on {_ranks(e, h.rank)}; {_fix(cause.errno)}") from e


def _fix(code: int) -> str:
    import errno

    if code in (errno.ENOSPC, errno.EDQUOT):  # (disk_full)
        return ("free space there, keep fewer checkpoints (trainer.keep_last: the resumed run prunes to it "
                "before it trains), or point hydra.run.dir at a disk with room")
    return "point hydra.run.dir at a directory every rank can write"


def disk_full(error: BaseException) -> bool:
    """A write refused for want of space: the disk, or the user's quota."""
    import errno

    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


FULL_BYTES = 1 << 20
"""A filesystem with less than this free for unprivileged users counts as full after a write
failed there without saying why (torch.save's "file write failed")."""


def write_error(error: BaseException, where: Path) -> OSError | None:
    """The OSError under a failed checkpoint write (``error``, its causes and torch DCP's per-rank
    failures), or, when none says why (torch.save reports a full disk as a failed write only),
    ENOSPC if the filesystem holding ``where`` is full now; None when the failure is no write
    error."""
    import errno
    import os

    if not isinstance(error, Exception) and not isinstance(getattr(error, "failures", None), dict):
        return None  # an interrupt, a SystemExit: not a write's failure, whatever it interrupted
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno and not isinstance(e, ConnectionError):  # (a peer gone)
            return e
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (error, trace)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    here = Path(where)
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        fs = os.statvfs(here)
    except OSError:
        return None
    if fs.f_bavail * fs.f_frsize < FULL_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def _ranks(error: BaseException, rank: int) -> str:
    """The ranks whose writes failed: torch DCP's collective save says; else this one."""
    failures = getattr(error, "failures", None)
    ranks = sorted(failures) if isinstance(failures, dict) and failures else [rank]
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _save(h: Handles, job: Job, run_dir: str | Path, step: int, history: dict[str, Any] | None,
          temp: Path, final: Path) -> Path:
    from checkpoints import hosts, state, store, timeline

    per_host = hosts.leaders(run_dir)  # (None: one directory, rank 0 commits)
    lead = h.rank == 0 if per_host is None else h.rank in per_host
    if lead and temp.exists():
        shutil.rmtree(temp)
    state._barrier()
    state.save(h, temp)
    if h.rank == 0:
        _write_config(temp, job)
        (temp / store.HISTORY).write_text(json.dumps(history or {}) + "\n")
        store.write_meta(temp, _meta(h, job, step))
    # COMPLETE only when every rank's files are here (a run directory not shared between nodes
    # would leave them elsewhere) -- or, per host (checkpoints/hosts.py), in the union of the
    # directories; every directory gets the one manifest
    if per_host is None:
        files = store.listing(temp) if h.rank == 0 else {}
        absent = _from_rank0(store.missing_ranks(set(files), h.world_size) if h.rank == 0 else None)
    else:
        files, absent = hosts.union(store.listing(temp) if lead else None, h.rank, h.world_size)
    if absent:
        raise CheckpointError(f"{temp}: rank(s) {', '.join(map(str, absent))} wrote their files "
                              "elsewhere: the run directory is not one directory for every rank; set "
                              "hydra.run.dir to a path on a filesystem all nodes share")
    if lead:
        store.finish(temp, final, store.manifest(files))
        timeline.pruned(job, run_dir, step, history)  # (never the one just saved)
        log.info("checkpoint: %s", final)
    state._barrier()
    return final


def stopped_early(ckpt: Checkpoint, trainer: Any) -> bool:
    """``ckpt`` is where an early stop ended its run (its validations say stop at its step)."""
    from recipes.stopping import EARLY_STOPPING, stopped

    records = [v for v in ckpt.history().get("validation", []) if v["step"] <= ckpt.step]
    return stopped(records, trainer, ckpt.step)["reason"] == EARLY_STOPPING


def start(job: Job, run_dir: str | Path, *, rank: int, world_size: int, device: Any = None
          ) -> Checkpoint | None:
    """Every rank, once the process group exists, before the first step: check that a
    multi-node job's run directory is one directory for every rank, then agree on the checkpoint
    to resume (``trainer.resume_from``; ``auto``: rank 0 finds the newest complete one -- again
    on every restart of the workers -- and the others take its answer). First this rank's
    training RNG is seeded from ``trainer.seed`` (``recipes.training.seed_training``): the RNG a
    fresh run starts from, which ``load`` replaces with the checkpoint's."""
    from recipes.training import seed_training

    seed_training(job.trainer.seed, job.mesh, rank)
    if job.mesh.nodes > 1:
        _check_shared(Path(run_dir), rank, world_size)
    resume_from = job.trainer.resume_from
    if resume_from is None:
        return None
    answer: tuple[str | None, str | None] = (None, None)
    if rank == 0:
        try:
            found = resolve(resume_from, run_dir, cleanup=False)
            answer = (str(found.path) if found else None, None)
        except CheckpointError as e:
            answer = (None, str(e))
    path, error = _from_rank0(answer)
    if error:
        raise CheckpointError(error)
    if path and hosts.leaders(run_dir) is not None:  # (each host: the same step in its own directory)
        path = str(Path(run_dir) / Path(path).relative_to(Path(path).parents[1]))
    return read(path) if path else None


def resuming(job: Job, run_dir: str | Path) -> bool:
    """Whether this run continues from a checkpoint (what ``start`` will find), answered from the
    run directory before the process group exists: a backend building before it (objective=dpo's
    reference pass, recipes/dpo.py) reads its cache back only on a resume. The launcher removed
    interrupted saves before any rank started, so every rank sees the same checkpoints."""
    resume_from = job.trainer.resume_from
    if resume_from is None:
        return False
    if resume_from != AUTO:
        return True
    if not hosts.declared():
        return latest(run_dir) is not None
    from checkpoints.store import latest_whole

    return latest_whole(run_dir)[0] is not None  # (what ``_whole`` finds; rank 0 says what it skips)


def _from_rank0(value: Any) -> Any:
    """``value`` as rank 0 has it, on every rank (itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_shared(run_dir: Path, rank: int, world_size: int) -> None:
    """Every rank must see the markers every other rank writes into the run directory, unless
    the launcher declared it one per host (checkpoints/hosts.py)."""
    seen = hosts.layout(run_dir, rank, world_size, _from_rank0)
    blind = [(r, host) for r, (group, host) in enumerate(seen) if 0 not in group]
    if blind and hosts.leaders(run_dir) is None:
        from strategies import ConfigError

        who = ", ".join(f"rank {r} on {host}" for r, host in blind)
        raise ConfigError(f"hydra.run.dir={run_dir} is not one directory for every node: {who} "
                          "cannot read the file rank 0 wrote there. Every rank writes its "
                          "checkpoint files into the run directory and rank 0 completes them, so "
                          "it must be on a filesystem all nodes share: set hydra.run.dir=<shared "
                          "path> (the same on every node)")


def load(h: Handles, ckpt: Checkpoint) -> int:
    """Every rank: restore everything ``ckpt`` holds into the engine; returns its step."""
    from checkpoints import state

    state.load(h, ckpt)
    return ckpt.step


def _meta(h: Handles, job: Job, step: int) -> dict[str, Any]:
    import torch

    from checkpoints import state
    from recipes.tokens import input_fingerprints

    return {"step": step, "samples_seen": step * job.batch.global_size, "world_size": h.world_size,
            "strategy": job.strategy.name, "strategy_option": job.strategy_option,
            "family": job.strategy.family, "backend": job.backend,
            "payload": h.format, "prefix": h.prefix, "scheduler": state.scheduler_state(h),
            "shapes": shapes(job.model), "torch": torch.__version__, "config": job.meta()["config"],
            "inputs": input_fingerprints(job.data)}  # (checkpoints/data_stream.py ``input_changes``)


def _write_config(temp: Path, job: Job) -> None:
    from omegaconf import OmegaConf

    (temp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(job.meta()["config"])))
