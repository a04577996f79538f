"""A Hydra sweep (``train.py -m ...``) as a strategy comparison: every job leaves a status in its
own directory, and after the last job the sweep directory gets ``sweep_report.md``,
``sweep_report.json`` (``{"rows": [...]}``, one row per job) and ``sweep_report.png``.

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
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

import checkpoints
from launchers import slurm
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
        raise SystemExit(e.code) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001  (a failed job is a row, the sweep goes on)
        if slurm.stopped_by_slurm(e):
            slurm.leave_without_result()
        reason = str(e) if not isinstance(e, SystemExit) else f"exit code {e.code}"
        log.error("job failed: %s\n%s", reason, traceback.format_exc())
        record(out, FAILED, f"{type(e).__name__}: {reason}")
        return None
    record(out, OK)
    return result


# --------------------------------------------------------------------------- the report
def _job_dirs(sweep: Path) -> list[Path]:
    """The sweep's job directories, in job order (each has Hydra's ``.hydra/overrides.yaml``)."""
    dirs = [p.parent.parent for p in sweep.glob("**/.hydra/overrides.yaml")]
    return sorted(dirs, key=lambda p: (len(p.parts), int(p.name) if p.name.isdigit() else 0, str(p)))


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
    if report is None and r["status"] == OK:
        r["status"], r["reason"] = FAILED, "no report.json (the job did not finish)"
    config = job_dir / ".hydra" / "config.yaml"
    if config.exists():
        cfg = OmegaConf.load(config)
        r["strategy"] = cfg.strategy.name
        r["world_size"] = cfg.cluster.nodes * cfg.cluster.devices
    else:  # a job that never started (cancelled in the queue)
        r["strategy"] = next((o.split("=", 1)[1] for o in overrides if o.startswith("strategy=")), "?")
        r["world_size"] = None
    plan = status.get("plan") or (report or {}).get("plan") or {}
    r["predicted_fits"] = plan.get("fits")
    if report is None:
        if plan.get("memory"):
            r["predicted_device_bytes"] = plan["memory"]["total"]
        return r
    ranks = report.get("memory", {}).get("ranks", [])
    comm = report.get("communication", {}).get("per_step", {})
    pvm = report.get("predicted_vs_measured", {})
    r.update({
        "steps": report.get("steps"),
        "final_loss": report.get("final_loss"),
        "tokens_per_second": report.get("throughput", {}).get("tokens_per_second",
                                                              report.get("tokens_per_second")),
        "wall_seconds": report.get("wall_seconds"),
        "step_seconds": report.get("throughput", {}).get("step_seconds"),
        "state_bytes_per_rank": [sum(x.get(k, 0) for k in ("params", "grads", "optimizer")) for x in ranks],
        "peak_memory_per_rank": [_peak(x) for x in ranks],
        # what rank 0 sends per step on a ring: the planner's unit (observers/compare.py)
        "comm_bytes_per_step": sum(v["wire_bytes"] for v in comm.values()) if comm else None,
        "predicted_state_bytes": pvm.get("state_bytes", {}).get("predicted"),
        "predicted_comm_bytes_per_step": pvm.get("communication", {}).get("predicted",
                                                                          plan.get("communication", {}).get("bytes_per_step")),
        "predicted_step_seconds": plan.get("step_seconds"),
    })
    return r


def _peak(rank: dict[str, Any]) -> int | None:
    """A rank's peak memory: the GPU's peak allocation when there is one, else its peak RSS."""
    cuda = rank.get("cuda")
    if cuda:
        return max((v.get("allocated", 0) for v in cuda.values() if isinstance(v, dict)), default=None)
    return rank.get("peak_rss")


def collect(sweep: Path) -> list[dict[str, Any]]:
    return [row(d, sweep) for d in _job_dirs(sweep)]


def _mib(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, list):
        return " / ".join(_mib(v) for v in x) if x else "-"
    return f"{x / 2**20:,.2f}"


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


COLUMNS = ("job", "overrides", "status", "final loss", "tokens/s", "step s", "state MiB per rank",
           "peak MiB per rank", "comm MiB/step", "predicted: fits", "state MiB", "comm MiB/step")


def markdown(rows: list[dict[str, Any]], sweep: Path) -> str:
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    lines = [f"# Sweep report: {sweep}", "",
             "Measured (rank 0 for communication; every rank for memory) beside the planner's "
             "prediction. Peak memory: the GPU's peak allocation, on CPU the process's peak RSS. "
             "Communication: bytes rank 0 sends per optimizer step on a ring.", "",
             "Every job: " + (" ".join(f"`{o}`" for o in sorted(common)) or "-"), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        fits = {True: "yes", False: "no", None: "-"}[r.get("predicted_fits")]
        lines.append("| " + " | ".join([
            r["job"], " ".join(f"`{o}`" for o in r["overrides"] if o not in common) or "-", r["status"],
            _num(r.get("final_loss"), ".4f"), _num(r.get("tokens_per_second"), ",.0f"),
            _num(r.get("step_seconds"), ".3f"), _mib(r.get("state_bytes_per_rank")), _mib(r.get("peak_memory_per_rank")),
            _mib(r.get("comm_bytes_per_step")), fits, _mib(r.get("predicted_state_bytes")),
            _mib(r.get("predicted_comm_bytes_per_step"))]) + " |")
    notes = [r for r in rows if r["status"] != OK]
    if notes:
        lines += ["", "## Not run or failed", ""]
        lines += [f"- job {r['job']} ({r['status']}): {_one_line(r.get('reason'))}" for r in notes]
    return "\n".join(lines) + "\n"


def _one_line(text: str | None) -> str:
    return " ".join((text or "no reason recorded").split())[:600]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Five panels, one bar per job: tokens/s; model states (max over ranks) and communication per
    step, each measured beside predicted; peak memory (max over ranks); and the final loss against
    the measured communication per step, one point per job (what each byte bought)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['job']}: {r['strategy']}" + ("" if r["status"] == OK else f"\n({r['status']})")
              for r in rows]
    x = range(len(rows))

    def get(key: str, scale: float = 1.0) -> list[float]:
        out = []
        for r in rows:
            v = r.get(key)
            v = max(v) if isinstance(v, list) and v else (v if not isinstance(v, list) else None)
            out.append((v or 0) / scale)
        return out

    fig, axes = plt.subplots(1, 5, figsize=(8 + 2.8 * len(rows), 4))
    w = 0.4
    axes[0].bar(x, get("tokens_per_second"))
    axes[0].set_title("tokens/s")
    for ax, (measured, predicted, title, scale) in zip(axes[1:], [
            ("state_bytes_per_rank", "predicted_state_bytes", "model states per rank, MiB", 2**20),
            ("peak_memory_per_rank", None, "peak memory per rank, MiB", 2**20),
            ("comm_bytes_per_step", "predicted_comm_bytes_per_step", "communication per step, MiB", 2**20)]):
        if predicted is None:
            ax.bar(x, get(measured, scale))
        else:
            ax.bar([i - w / 2 for i in x], get(measured, scale), w, label="measured (max rank)")
            ax.bar([i + w / 2 for i in x], get(predicted, scale), w, label="predicted")
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
    for ax in axes[:4]:
        ax.set_xticks(list(x), labels, fontsize=7, rotation=20)
    done = [r for r in rows if r.get("final_loss") is not None and r.get("comm_bytes_per_step")]
    for r in done:
        axes[4].scatter(r["comm_bytes_per_step"] / 2**20, r["final_loss"])
        axes[4].annotate(r["strategy"], (r["comm_bytes_per_step"] / 2**20, r["final_loss"]), fontsize=7)
    if done:
        axes[4].set_xscale("log")
    axes[4].set_xlabel("communication per step, MiB (measured)", fontsize=8)
    axes[4].set_title("final loss vs bytes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(sweep: Path) -> list[dict[str, Any]]:
    """The sweep report files for the jobs found under ``sweep``; returns the rows."""
    rows = collect(sweep)
    atomic_write_text(sweep / "sweep_report.json", json.dumps({"rows": rows}, indent=1, default=str))
    atomic_write_text(sweep / "sweep_report.md", markdown(rows, sweep))
    if rows:
        plot(rows, sweep / "sweep_report.png")
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


def preflight(config: DictConfig) -> list[tuple[list[str], list[str]]]:
    """Every point of the sweep composed and validated as its job will be (torch-free, before
    anything is started or queued): (point, its problems) for the invalid ones."""
    from recipes.config import compose
    from recipes.job import RUN, validate
    from strategies import ConfigError

    bad = []
    for point in points(config) or []:
        try:
            validate(compose(point), depth=RUN)
        except ConfigError as e:
            bad.append((point, e.problems))
        except Exception as e:  # noqa: BLE001  (Hydra refuses to compose it)
            bad.append((point, [str(e).splitlines()[0]]))
    return bad


class SweepReport(Callback):
    """Hydra callback (conf/hydra/default.yaml): before a multirun starts or queues anything,
    every point is validated (one message for all, exit 2); after it, the comparison report, and
    exit 1 when any job failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from recipes import cli

        cli.started()  # (the sweep composed: from here a failure is not a configuration error)
        bad = preflight(config)
        if bad:
            lines = [f"{len(bad)} of the sweep's jobs cannot run; nothing was started:"]
            for point, found in bad:
                lines.append(f"  {' '.join(point)}")
                lines += [f"    - {p}" for p in found]
            log.error("%s", "\n".join(lines))
            sys.exit(cli.CONFIG_ERROR)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        rows = write(sweep)
        counts = {s: sum(r["status"] == s for r in rows) for s in (OK, SKIPPED, FAILED)}
        log.info("sweep report: %s (%d ok, %d skipped, %d failed)", sweep / "sweep_report.md",
                 counts[OK], counts[SKIPPED], counts[FAILED])
        if counts[FAILED]:
            sys.exit(1)
