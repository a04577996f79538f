"""A Hydra sweep (``train.py -m ...``) as a strategy comparison: every job leaves a status in its
own directory, and after the last job the sweep directory gets ``sweep_report.md``,
``sweep_report.json`` (``{"rows": [...], "pick": ...}``, one row per job), ``sweep_report.png``
and ``sweep_losses.png`` (every job's loss curve on one axis). The rows put the median step time
(first step excluded), the time to the first step and the peak memory beside the planner's
prediction; the closing line (``pick``) names the job to choose and why: the fastest that fits
with margin at the best final loss.

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
from observers.compare import sweep_facts
from observers.files import atomic_write_text
from planner import WillNotFit

log = logging.getLogger(__name__)

STATUS = "job.json"
"""A job's status file: ``{"status": "ok" | "skipped" | "failed", "reason": ..., "plan": ...}``."""
OK, SKIPPED, FAILED = "ok", "skipped", "failed"


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


# --------------------------------------------------------------------------- the report
def _job_dirs(sweep: Path, earlier: dict[Path, int] | None = None) -> list[Path]:
    """The sweep's job directories, in job order (each has Hydra's ``.hydra/overrides.yaml``),
    without those ``earlier`` holds that no job rewrote since (``stamps``: an earlier sweep's jobs
    in the same directory, beyond this sweep's count)."""
    dirs = [p.parent.parent for p in sweep.glob("**/.hydra/overrides.yaml")]
    dirs = [d for d in dirs if earlier is None or earlier.get(d) != _stamp(d)]
    return sorted(dirs, key=lambda p: (len(p.parts), int(p.name) if p.name.isdigit() else 0, str(p)))


def _stamp(job_dir: Path) -> int:
    return (job_dir / ".hydra" / "overrides.yaml").stat().st_mtime_ns


def stamps(sweep: Path) -> dict[Path, int]:  # (the job directories in ``sweep`` before it starts)
    return {d: _stamp(d) for d in _job_dirs(sweep)}


_earlier: dict[str, dict[Path, int]] = {}
"""This process's sweep's ``stamps`` (SweepReport sets it): a stopped sweep's report (``guard``)."""


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def row(job_dir: Path, sweep: Path) -> dict[str, Any]:
    """One job as a row: what it ran and what it measured, beside the planner's prediction."""
    overrides = OmegaConf.to_container(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"))
    status = _read(job_dir / STATUS) or {}
    report = _read(job_dir / "report.json")
    r: dict[str, Any] = {"job": str(job_dir.relative_to(sweep)), "overrides": overrides,
                         "status": status.get("status") or (OK if report else FAILED),
                         "reason": status.get("reason")}
    config = job_dir / ".hydra" / "config.yaml"
    reports = True
    if config.exists():
        from recipes.compose import register

        register()  # (the resolvers of its interpolations: ${launched:...})

        cfg = OmegaConf.load(config)
        r["strategy"] = cfg.strategy.name
        r["world_size"] = cfg.cluster.nodes * cfg.cluster.devices
        reports = OmegaConf.select(cfg, "callbacks.report", default=True) is not False
    else:  # a job that never started (cancelled in the queue)
        r["strategy"] = next((o.split("=", 1)[1] for o in overrides if o.startswith("strategy=")), "?")
        r["world_size"] = None
    if report is None and r["status"] == OK:
        r["status"], r["reason"] = ((OK, "callbacks.report=false: nothing measured") if not reports
                                    else (FAILED, "no report.json (the job did not finish)"))
    plan = status.get("plan") or (report or {}).get("plan") or {}
    r["predicted_fits"] = plan.get("fits")
    r["predicted_tight"] = plan.get("tight")
    r["device_memory"] = plan.get("device_memory")
    if report is None:
        if plan.get("memory"):
            r["predicted_device_bytes"] = plan["memory"]["total"]
        return r
    ranks = report.get("memory", {}).get("ranks", [])
    pvm = report.get("predicted_vs_measured", {})
    r.update({
        "steps": report.get("steps"),
        "final_loss": report.get("final_loss"),
        "wall_seconds": report.get("wall_seconds"),
        "step_seconds": report.get("throughput", {}).get("step_seconds"),
        "state_bytes_per_rank": [sum(x.get(k, 0) for k in ("params", "grads", "optimizer")) for x in ranks],
        "peak_memory_per_rank": [_peak(x) for x in ranks],
        **sweep_facts(report),  # tokens/s and what rank 0 sends per step, each with what it is
        "predicted_state_bytes": pvm.get("state_bytes", {}).get("predicted"),
        "predicted_comm_bytes_per_step": pvm.get("communication", {}).get("predicted",
                                                                          plan.get("communication", {}).get("bytes_per_step")),
        "predicted_step_seconds": plan.get("step_seconds"),
        # from starting the ranks to the end of the first optimizer step: the job's own start-up
        # (the interpreter's import, which the sweep's first job alone pays, config and plan aside)
        "first_step_seconds": _own_startup(report.get("startup") or {}),
        "losses": report.get("losses"),
    })
    return r


def _own_startup(startup: dict[str, Any]) -> float | None:
    seconds = startup.get("seconds") or {}
    return round(sum(v for k, v in seconds.items() if k not in SHARED), 4) if seconds else startup.get("total")


SHARED = ("import", "config", "plan")
"""Start-up phases that are the sweep's more than the job's (observers/startup.py)."""


def _peak(rank: dict[str, Any]) -> int | None:
    """A rank's peak memory: the GPU's peak allocation when there is one, else its peak RSS."""
    cuda = rank.get("cuda")
    if cuda:
        return max((v.get("allocated", 0) for v in cuda.values() if isinstance(v, dict)), default=None)
    return rank.get("peak_rss")


def collect(sweep: Path, earlier: dict[Path, int] | None = None) -> list[dict[str, Any]]:
    return [row(d, sweep) for d in _job_dirs(sweep, earlier)]


def _mib(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, list):
        return " / ".join(_mib(v) for v in x) if x else "-"
    return f"{x / 2**20:,.2f}"


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = ("job", "overrides", "status", "final loss", "tokens/s", "step s (median)", "first step s",
           "state MiB per rank", "peak MiB per rank", "comm MiB/step", "predicted: fits", "step s",
           "state MiB", "comm MiB/step")


def markdown(rows: list[dict[str, Any]], sweep: Path) -> str:
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    lines = [f"# Sweep report: {sweep}", "",
             "Measured (rank 0 for communication; every rank for memory) beside the planner's "
             "prediction. Tokens/s: at the median step; \"(whole loop)\": callbacks.throughput was "
             "off, the loop's rate, first step included. Peak memory: the GPU's peak allocation, on CPU the process's peak RSS. "
             "Communication: bytes rank 0 sends per optimizer step on a ring, after the preset's "
             "warm-up (the steady state the plan prices; \"(warm-up)\": the run never left it).", "",
             "Every job: " + (" ".join(f"`{o}`" for o in sorted(common)) or "-"), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        fits = {True: "yes", False: "no", None: "-"}[r.get("predicted_fits")]
        lines.append("| " + " | ".join([
            r["job"], " ".join(f"`{o}`" for o in r["overrides"] if o not in common) or "-", r["status"],
            _num(r.get("final_loss"), ".4f"), _num(r.get("tokens_per_second"), ",.0f")
            + (" (whole loop)" if r.get("tokens_per_second_of") == "whole loop" else ""),
            _num(r.get("step_seconds"), ".3g"), _num(r.get("first_step_seconds"), ".1f"),
            _mib(r.get("state_bytes_per_rank")), _mib(r.get("peak_memory_per_rank")),
            _mib(r.get("comm_bytes_per_step")) + (" (warm-up)" if r.get("comm_of") == "warm-up" else ""),
            fits, _num(r.get("predicted_step_seconds"), ".3g"),
            _mib(r.get("predicted_state_bytes")), _mib(r.get("predicted_comm_bytes_per_step"))]) + " |")
    notes = [r for r in rows if r["status"] != OK]
    if notes:
        lines += ["", "## Not run or failed", ""]
        lines += [f"- job {r['job']} ({r['status']}): {_one_line(r.get('reason'))}" for r in notes]
    if any(r.get("losses") for r in rows):
        lines += ["", "![the loss of every job](sweep_losses.png)"]
    lines += ["", pick(rows, common)[0]]
    return "\n".join(lines) + "\n"


LOSS_TOLERANCE = 0.01
"""Final losses within this fraction of the best count as equal when picking."""


def pick(rows: list[dict[str, Any]], common: set[str] = frozenset()) -> tuple[str, str | None]:
    """The closing line: the job to choose and why -- the fastest median step among the jobs that
    finished, reach the best final loss (within ``LOSS_TOLERANCE``) and fit with margin (the
    planner's verdict not tight, the measured peak under the device's memory); a tight or lossy
    job only when nothing else qualifies, and saying so."""
    done = [r for r in rows if r["status"] == OK and r.get("final_loss") is not None
            and r.get("step_seconds")]
    if not done:
        return "pick: none -- no job finished with a measured step time", None
    best_loss = min(r["final_loss"] for r in done)
    equal = [r for r in done if r["final_loss"] <= best_loss + LOSS_TOLERANCE * abs(best_loss)]

    def margin(r: dict[str, Any]) -> bool:
        peak, device = max(r.get("peak_memory_per_rank") or [0], default=0), r.get("device_memory")
        return r.get("predicted_fits") is not False and not r.get("predicted_tight") \
            and not (device and peak and peak > device)

    roomy = [r for r in equal if margin(r)]
    best = min(roomy or equal, key=lambda r: r["step_seconds"])
    what = " ".join(f"`{o}`" for o in best["overrides"] if o not in common) or best["strategy"]
    why = (f"the fastest median step ({best['step_seconds']:.3g} s, first step excluded) among the "
           f"{len(roomy or equal)} job(s) that"
           + (" fit with margin and" if roomy else " (none fits with margin: this one is tight) and")
           + f" reach the best final loss within {LOSS_TOLERANCE:.0%} ({best['final_loss']:.4f}; "
           f"best {best_loss:.4f})")
    left = [r for r in done if r not in equal]
    if left:
        why += "; " + ", ".join(f"job {r['job']} ended higher ({r['final_loss']:.4f})" for r in left)
    return f"pick: job {best['job']} ({what}): {why}", best["job"]


def _one_line(text: str | None) -> str:
    return " ".join((text or "no reason recorded").split())[:600]


def write(sweep: Path, earlier: dict[Path, int] | None = None) -> list[dict[str, Any]]:
    """The sweep report files for the jobs under ``sweep`` (not ``earlier``'s); returns the rows."""
    rows = collect(sweep, earlier)
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    line, job = pick(rows, common)
    atomic_write_text(sweep / "sweep_report.json", json.dumps({"rows": rows, "pick": line, "pick_job": job},
                                                              indent=1, default=str))
    atomic_write_text(sweep / "sweep_report.md", markdown(rows, sweep))
    if rows:
        from observers.plots import job_names, losses_overlay, sweep_panels

        sweep_panels(rows, sweep / "sweep_report.png")
        curves = {name: r["losses"] for name, r in zip(job_names(rows), rows) if r.get("losses")}
        if curves:
            losses_overlay(curves, sweep / "sweep_losses.png")
    return rows


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


def check_point(overrides: Sequence[str], local: bool = False) -> Point:
    """One point composed, chosen (strategy=auto), validated and planned, as its job will be
    (torch-free at RUN depth: the backend's own refusals and the resume check come at the job's
    start). ``local``: this process runs the job (a local sweep, ``--dry-run`` without a
    submission): the launcher's own check too, and ``depth`` says how deep; at LAUNCH depth a
    ``trainer.resume_from`` path is checked as the run checks it (``checkpoints.checked``; ``auto``
    is the job's run directory's, which does not exist yet)."""
    import launchers
    import planner
    from recipes.compose import compose
    from recipes.job import LAUNCH, validate
    from strategies import ConfigError

    t0 = time.perf_counter()
    point = Point(list(overrides))
    try:
        cfg = compose(point.overrides)
        if local:  # (what train.py checks first: cluster=k8s or sagemaker is launch.py's)
            launchers.refuse_elsewhere(cfg)
        job = validate(cfg, depth=(deep := depth(cfg, local)), auto=planner.choose,
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
        from recipes.cli import composition_problems  # (ours, not Hydra's advice to add a key with +)

        point.problems = composition_problems(e, point.overrides) or [" ".join(str(e).split())[:600]
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


def preflight(points: Sequence[Sequence[str]], local: bool = False) -> Preflight:
    """Every point of a sweep (its override lists, as the launcher gets them) composed, validated
    and planned before anything is started or queued; ``.bad`` are the points that cannot run and
    ``.message()`` the report. Every launcher calls it: the local and Slurm sweeps through
    ``SweepReport`` (all of a basic sweep's points at once), other launchers on the batch their
    ``launch(job_overrides)`` receives (``refuse``). ``local``: this process runs the jobs
    (``check_point``)."""
    t0 = time.perf_counter()
    checked = [check_point(p, local) for p in points]
    return Preflight(checked, time.perf_counter() - t0)


_checked: set[tuple[str, ...]] = set()
"""Points this process has preflighted already (a launcher's batch after SweepReport's sweep)."""


def refuse(points: Sequence[Sequence[str]], config: DictConfig | None = None,
           started: str = "started", local: bool = False) -> Preflight | None:
    """Preflight the points not checked yet in this process and exit 2 with the report when any
    cannot run (before the caller starts or queues anything); ``config``: the sweep's, whose
    ``preflight=false`` (``+preflight=false`` on the command line) skips the check. For launchers:
    call it first thing in ``launch(job_overrides, ...)``; ``local``: this process runs them."""
    from recipes import cli

    if config is not None and not enabled(config):
        return None
    todo = [list(p) for p in points if tuple(p) not in _checked]
    if not todo:
        return None
    result = preflight(todo, local)
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
            refuse(jobs, started="queued" if target.endswith("SlurmLauncher") else "started",
                   local=target.endswith("BasicLauncher"))  # (Hydra's: each job in this process)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        earlier = getattr(self, "earlier", None)
        rows = write(sweep, earlier)
        ran = set(_job_dirs(sweep, earlier))
        if stale := [d for d in _job_dirs(sweep) if d not in ran]:
            log.warning("sweep report: left out %s, which an earlier sweep in %s left: this one did "
                        "not run them", ", ".join(str(d.relative_to(sweep)) for d in stale), sweep)
        counts = {s: sum(r["status"] == s for r in rows) for s in (OK, SKIPPED, FAILED)}
        log.info("sweep report: %s (%d ok, %d skipped, %d failed)", sweep / "sweep_report.md",
                 counts[OK], counts[SKIPPED], counts[FAILED])
        log.info("%s", json.loads((sweep / "sweep_report.json").read_text())["pick"])
        if counts[FAILED]:
            sys.exit(1)
