"""A Hydra sweep (``train.py -m ...``) as a strategy comparison: every job leaves a status in its
own directory, and after the last job the sweep directory gets the comparison report
(``launchers/sweep_report.py``: one row per job beside the planner's prediction, and the job to
choose).

Before anything is started or queued, every point is composed, validated and planned
(``preflight``: ``SweepReport`` for a basic sweep, ``refuse`` for a launcher's batch): one
report lists each point that cannot run -- its configuration errors, or "will not fit" -- and
the sweep exits 2 starting nothing; ``+preflight=false`` skips it.

A job of a sweep never ends the sweep: a run the planner predicts will not fit is *skipped*
with the planner's reason (unless ``planner.enforce=false``), a run that fails is a row with its
error, and the next job starts (``guard``). The report is built from the job directories only
(``report.json`` and ``job.json``), so it is the same whichever launcher ran the jobs -- one
after another here, or as a Slurm array through hydra-submitit-launcher.

Torch-free: Hydra instantiates ``SweepReport`` in the process that drives the sweep.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

import checkpoints
from core.errors import ConfigError, DataError
from launchers import slurm
from launchers.sweep_report import FAILED, OK, SKIPPED, STATUS, job_dirs, stamps, write
from observers.files import atomic_write_text
from planner import WillNotFit

log = logging.getLogger(__name__)



def record(out: Path, status: str, reason: str | None = None, plan: dict[str, Any] | None = None) -> None:
    """Write this job's status into its directory (rank 0 of the job: under srun every task
    runs the job function)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    atomic_write_text(out / STATUS, json.dumps({"status": status, "reason": reason, "plan": plan},
                                               indent=1, default=str))


def guard(out: Path, job: Callable[[], Any]) -> Any:
    """Run one job of a sweep: its status is recorded, and no error escapes to end the sweep.
    ``SystemExit`` (a configuration error's exit 2) is a failed job like any other; Slurm's
    SIGTERM (a requeue) is not a result at all (slurm.leave_without_result)."""
    from launchers.local import Stopped
    from observers import startup

    try:
        result = job()
    except WillNotFit as e:
        log.warning("skipped: %s", e)
        record(out, SKIPPED, str(e), e.plan)
        return None
    except checkpoints.Finished as e:  # this job was done before (a re-run, a requeue): its report stands
        log.info("%s", e)
        record(out, OK)
        return None
    except Stopped as e:  # a signal for the sweep, not this job's fault: the sweep stops too
        record(out, FAILED, str(e))
        if not slurm.in_job():  # (a Slurm job's stop: its requeue, or a failed row of the array)
            from launchers import sweep_dir

            sweep_dir.stopped(e, _earlier.get("stamps"))
        raise SystemExit(e.code) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001  (a failed job is a row, the sweep goes on)
        if slurm.stopped_by_slurm(e):
            slurm.leave_without_result()
        reason = str(e) if not isinstance(e, SystemExit) else f"exit code {e.code}"
        said = isinstance(e, (SystemExit, ConfigError, DataError))  # (a configuration error: its one line)
        log.error("job failed: %s%s", reason, "" if said else "\n" + traceback.format_exc())
        record(out, FAILED, f"{type(e).__name__}: {reason}")
        return None
    finally:
        startup.restart()  # the next job's start-up begins here (report.json's startup)
    record(out, OK)
    return result


_earlier: dict[str, dict[Path, int]] = {}
"""This process's sweep's ``stamps`` (SweepReport sets it): a stopped sweep's report (``guard``)."""


def points(config: DictConfig) -> list[list[str]] | None:
    """The sweep's jobs as override lists, as Hydra's basic sweeper will expand them (None: another
    sweeper, which expands its own)."""
    sweeper = str(config.hydra.sweeper.get("_target_", ""))
    if not sweeper.endswith("BasicSweeper"):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


@dataclass
class Point:
    """One point of a sweep as preflight found it."""

    overrides: list[str]
    problems: list[str] = field(default_factory=list)
    """Why it cannot run: its configuration errors, or the planner's "will not fit"."""
    plan: str | None = None
    """The planner's one line for a point that validated (or why it will not fit)."""
    fits: bool | None = None
    seconds: float = 0.0


@dataclass
class Preflight:
    """Every point of a sweep composed, validated and planned before anything starts."""

    points: list[Point]
    seconds: float = 0.0

    @property
    def bad(self) -> list[Point]:
        return [p for p in self.points if p.problems]

    def table(self) -> str:
        """One line per point (its overrides that differ from the others'), then its problems."""
        # (a single job's overrides are its own, not common to others: --dry-run shows them)
        common = set.intersection(*(set(p.overrides) for p in self.points)) if len(self.points) > 1 else set()
        lines = []
        for i, p in enumerate(self.points):
            mine = " ".join(o for o in p.overrides if o not in common) or "(the base config)"
            verdict = ("will not fit" if p.fits is False and p.problems else
                       "invalid" if p.problems else "ok")
            lines.append(f"  {i:>3}  {verdict:<12}  {mine}")
            lines += [f"         - {x}" for x in p.problems]
            if not p.problems and p.plan:
                lines.append(f"         {p.plan}")
        return "\n".join(lines)

    def message(self, started: str = "started") -> str:
        head = (f"preflight: {len(self.bad)} of the sweep's {len(self.points)} jobs cannot run; "
                f"nothing was {started} (+preflight=false skips this check):" if self.bad else
                f"preflight: all {len(self.points)} jobs of the sweep compose, validate and plan "
                f"({self.seconds:.1f} s):")
        return head + "\n" + self.table()


def check_point(overrides: Sequence[str], local: bool = False, search: Sequence[str] = ()) -> Point:
    """One point composed, chosen (strategy=auto), validated and planned, as its job will be
    (torch-free at RUN depth: the backend's own refusals and the resume check come at the job's
    start). ``local``: this process runs the job (a local sweep, ``--dry-run`` without a
    submission): the launcher's own check too, and ``depth`` says how deep; at LAUNCH depth a
    ``trainer.resume_from`` path is checked as the run checks it (``checkpoints.checked``; ``auto``
    is the job's run directory's, which does not exist yet). ``search``: the command line's own
    config directories (recipes/compose.py's ``search_args``), composed with as its jobs are."""
    import launchers
    import planner
    from recipes.compose import compose_chosen
    from recipes.job import LAUNCH, validate
    from strategies import ConfigError

    t0 = time.perf_counter()
    point = Point(list(overrides))
    try:
        cfg, _, origin = compose_chosen([*search, *point.overrides])
        if local:  # (what train.py checks first: cluster=k8s or sagemaker is launch.py's)
            launchers.refuse_elsewhere(cfg)
        job = validate(cfg, depth=(deep := depth(cfg, local)), auto=planner.choose, origin=origin,
                       extra=[launchers.check] if local else ())
        if deep == LAUNCH:
            checkpoints.checked(job)
        result = planner.check(job)
        point.fits, point.plan = result.fits, result.summary()
    except WillNotFit as e:
        point.fits, point.plan = False, str(e)
        point.problems = [f"will not fit: {e}"]
    except ConfigError as e:
        point.problems = list(e.problems)
    except Exception as e:  # noqa: BLE001  (Hydra refuses to compose it: an unknown key or option)
        from recipes.cli_help import composition_problems  # (ours, not Hydra's advice to add a key with +)

        point.problems = composition_problems(e, [*search, *point.overrides]) or [" ".join(str(e).split())[:600]
                                                                      or type(e).__name__]
    point.seconds = time.perf_counter() - t0
    return point


def depth(cfg: DictConfig, local: bool) -> int:
    """How deep a point is validated: at LAUNCH depth (this machine's cores and GPUs, the files
    its paths name, as train.py checks) when its ranks start here -- ``cluster.launcher=local``
    run by this process -- else at RUN depth: the run, not this machine (a Slurm array, a
    multi-node torchrun command to run on other nodes; plan.py checks less still)."""
    from recipes.job import LAUNCH, RUN

    return LAUNCH if local and OmegaConf.select(cfg, "cluster.launcher") == "local" else RUN


def preflight(points: Sequence[Sequence[str]], local: bool = False, search: Sequence[str] = ()) -> Preflight:
    """Every point of a sweep (its override lists, as the launcher gets them) composed, validated
    and planned before anything is started or queued; ``.bad`` are the points that cannot run and
    ``.message()`` the report. Every launcher calls it: the local and Slurm sweeps through
    ``SweepReport`` (all of a basic sweep's points at once), other launchers on the batch their
    ``launch(job_overrides)`` receives (``refuse``). ``local``: this process runs the jobs
    (``check_point``), with the command line's config directories (``search``)."""
    t0 = time.perf_counter()
    checked = [check_point(p, local, search) for p in points]
    return Preflight(checked, time.perf_counter() - t0)


_checked: set[tuple[str, ...]] = set()
"""Points this process has preflighted already (a launcher's batch after SweepReport's sweep)."""


def refuse(points: Sequence[Sequence[str]], config: DictConfig | None = None,
           started: str = "started", local: bool = False) -> Preflight | None:
    """Preflight the points not checked yet in this process and exit 2 with the report when any
    cannot run (before the caller starts or queues anything); ``config``: the sweep's, whose
    ``preflight=false`` (``+preflight=false`` on the command line) skips the check. For launchers:
    call it first thing in ``launch(job_overrides, ...)``; ``local``: this process runs them. The
    points compose with the sweep's own config directories (``--config-dir``, ``hydra.searchpath``)."""
    from recipes import cli
    from recipes.compose import search_of

    if config is not None and not enabled(config):
        return None
    todo = [list(p) for p in points if tuple(p) not in _checked]
    if not todo:
        return None
    result = preflight(todo, local, search_of(config) if config is not None else ())
    _checked.update(tuple(p) for p in todo)
    if result.bad:
        log.error("%s", result.message(started))
        sys.exit(cli.CONFIG_ERROR)
    log.info("%s", result.message(started))
    return result


def enabled(config: DictConfig) -> bool:
    """The sweep's ``preflight`` key (``+preflight=false`` turns it off)."""
    return bool(OmegaConf.select(config, "preflight", default=True))


class SweepReport(Callback):
    """Hydra callback (conf/hydra/default.yaml): before a multirun starts or queues anything,
    every point is validated (one message for all, exit 2); after it, the comparison report, and
    exit 1 when any job failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from launchers import sweep_dir
        from recipes import cli

        cli.started()  # (the sweep composed: from here a failure is not a configuration error)
        self.earlier = _earlier["stamps"] = stamps(Path(str(config.hydra.sweep.dir)))
        jobs = points(config)
        if jobs is not None:  # (an earlier sweep's results in its job directories: not this sweep's)
            sweep_dir.refuse(config, jobs)
        if not enabled(config):
            log.warning("preflight=false: the sweep's points are checked only as each job starts")
            return
        if jobs is not None:  # another sweeper: its launcher checks each batch (refuse)
            target = str(config.hydra.launcher.get("_target_", ""))
            refuse(jobs, config, started="queued" if target.endswith("SlurmLauncher") else "started",
                   local=target.endswith("BasicLauncher"))  # (Hydra's: each job in this process)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        earlier = getattr(self, "earlier", None)
        rows = write(sweep, earlier)
        ran = set(job_dirs(sweep, earlier))
        if stale := [d for d in job_dirs(sweep) if d not in ran]:
            log.warning("sweep report: left out %s, which an earlier sweep in %s left: this one did "
                        "not run them", ", ".join(str(d.relative_to(sweep)) for d in stale), sweep)
        counts = {s: sum(r["status"] == s for r in rows) for s in (OK, SKIPPED, FAILED)}
        log.info("sweep report: %s (%d ok, %d skipped, %d failed)", sweep / "sweep_report.md",
                 counts[OK], counts[SKIPPED], counts[FAILED])
        log.info("%s", json.loads((sweep / "sweep_report.json").read_text())["pick"])
        if counts[FAILED]:
            sys.exit(1)
