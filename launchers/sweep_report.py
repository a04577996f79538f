"""A sweep's comparison report, built from its job directories only (each job's ``report.json``
and ``job.json``), so it is the same whichever launcher ran the jobs: ``sweep_report.md``,
``sweep_report.json`` (``{"rows": [...], "pick": ...}``, one row per job), ``sweep_report.png``
and ``sweep_losses.png``. The rows put the median step time (first step excluded), the time to
the first step and the peak memory beside the planner's prediction; ``pick`` names the job to
choose and why: the fastest that fits with margin at the best final loss. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from observers.compare import predicted_state_bytes, predicted_wire_bytes, sweep_facts
from observers.files import atomic_write_text

STATUS = "job.json"
"""A job's status file: ``{"status": "ok" | "skipped" | "failed", "reason": ..., "plan": ...}``."""
OK, SKIPPED, FAILED = "ok", "skipped", "failed"


def job_dirs(sweep: Path, earlier: dict[Path, int] | None = None) -> list[Path]:
    """The sweep's job directories, in job order (each has Hydra's ``.hydra/overrides.yaml``),
    without those ``earlier`` holds that no job rewrote since (``stamps``: an earlier sweep's jobs
    in the same directory, beyond this sweep's count)."""
    dirs = [p.parent.parent for p in sweep.glob("**/.hydra/overrides.yaml")]
    dirs = [d for d in dirs if earlier is None or earlier.get(d) != _stamp(d)]
    return sorted(dirs, key=lambda p: (len(p.parts), int(p.name) if p.name.isdigit() else 0, str(p)))


def _stamp(job_dir: Path) -> int:
    return (job_dir / ".hydra" / "overrides.yaml").stat().st_mtime_ns


def stamps(sweep: Path) -> dict[Path, int]:  # (the job directories in ``sweep`` before it starts)
    return {d: _stamp(d) for d in job_dirs(sweep)}


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
    if report is None:  # (skipped, failed: the plan its job.json recorded, as a report's would say)
        r["predicted_step_seconds"] = plan.get("step_seconds")
        if plan.get("memory"):
            r["predicted_device_bytes"] = plan["memory"]["total"]
            r["predicted_state_bytes"] = predicted_state_bytes(plan["memory"])
        if plan.get("communication"):
            r["predicted_comm_bytes_per_step"] = predicted_wire_bytes(plan["communication"])
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
    return [row(d, sweep) for d in job_dirs(sweep, earlier)]


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
             "warm-up (the steady state the plan prices; \"(warm-up)\": the run never left it; \"(part of a "
             "sync period)\": local SGD or DiLoCo measured for less than one strategy.sync_every).", "",
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
            _mib(r.get("comm_bytes_per_step")) + (f" ({r['comm_of']})" if r.get("comm_of") not in (None, "steady state")
                                                  else ""),
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
