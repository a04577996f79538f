"""Planner output: the JSON contract (docs/PLANNER.md) and rich tables for people."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from typing import Any

from planner.results import Plan, Report
from planner.states import GB, GiB, gb

MEMORY_KEYS = ("params", "grads", "master", "optimizer", "activations", "buffers", "loss", "step",
               "total", "growth", "host", "nvme")


def _finite(x: Any) -> Any:
    """JSON has no infinity: a time over a zero-bandwidth link is null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def plan_dict(p: Plan) -> dict[str, Any]:
    c = p.communication
    return _finite({
        "strategy": p.strategy,
        "fits": p.fits,
        "memory": {**{k: int(getattr(p.memory, k)) for k in MEMORY_KEYS},
                   "host_items": {k: int(v) for k, v in p.memory.host_items.items()}},
        "communication": {"bytes_per_step": c.bytes_per_step,
                          "seconds_per_step": c.seconds_per_step,
                          "by_collective": {k: asdict(v) for k, v in c.by_collective.items()}},
        "bubble_fraction": p.bubble_fraction,
        "step_seconds": p.step_seconds,
        "compute_seconds": p.compute_seconds,
        "exposed_seconds": p.exposed_seconds,
        "optimizer_seconds": p.optimizer_seconds,
        "engine_seconds": p.engine_seconds,
        "floor_seconds": p.floor_seconds,
        "compute": {"flops_per_step": p.flops_per_step, "peak_tflops": p.peak_tflops,
                    "peak_source": p.peak_source, "mfu": p.mfu},
        "device_memory": p.device_bytes,
        "margin": p.margin,
        "tight": p.tight,
        "verdict": p.verdict,
        "memory_fits": p.memory_fits,
        "runnable": p.runnable,
        "incomplete": list(p.missing),
        "tp": p.tp, "pp": p.pp, "dp": p.dp, "shard": p.shard, "cp": p.cp, "sp": p.sp, "ep": p.ep,
        "microbatches": p.microbatches,
        "activation_checkpointing": p.activation_checkpointing,
        "activations_full": p.activations_full,
        "activations_checkpointed": p.activations_checkpointed,
        "total_checkpointed": p.checkpointed_total or None,
        "planned_only": p.planned_only,
        "problems": list(p.problems),
        "notes": list(p.notes),
        "hint": p.hint,
    })


def report_dict(r: Report) -> dict[str, Any]:
    return {"model": r.model, "cluster": r.cluster, "world_size": r.world_size,
            "accounting": r.accounting, "plans": [plan_dict(p) for p in r.plans],
            "recommendation": {"strategy": r.recommendation.strategy,
                               "reason": r.recommendation.reason,
                               "micro_batch_size": r.recommendation.micro_batch_size,
                               "activation_checkpointing": r.recommendation.activation_checkpointing,
                               "with_checkpointing": r.recommendation.with_checkpointing,
                               "tight": r.recommendation.tight},
            "assumptions": list(r.assumptions), "batch": r.batch}


def render(report: Report, fmt: str = "table", detailed: bool = False, file: Any = None) -> None:
    """Print the report: one JSON object, the ranked table, or one plan's full breakdown."""
    file = file or sys.stdout
    if fmt == "json":
        file.write(json.dumps(report_dict(report), indent=2) + "\n")
        return
    if fmt != "table":
        raise ValueError(f"planner.format={fmt!r} is not one of table, json")
    from rich.console import Console

    con = Console(file=file, width=140, soft_wrap=False)
    con.print(f"[bold]{report.model}[/] on [bold]{report.cluster}[/] "
              f"({report.world_size} devices), accounting {report.accounting}; {report.batch}")
    if detailed:
        _breakdown(con, report.plans[0], report.accounting)
    else:
        _ranked(con, report)
    con.print("[dim]assumptions:[/]")
    for a in report.assumptions:
        con.print(f"[dim]  - {a}[/]")


ACCOUNTING_VIEW = {
    "actual": "accounting actual: what the engines allocate, phase by phase",
    "mixed16": "accounting mixed16: the reference documents' model (2+2+4+8 B/param states, no engine buffers)",
    "mixed20": "accounting mixed20: the deep-dive's model (2+6+4+8 B/param states, no engine buffers)",
}


def checkpointing_fits(p: Plan) -> int:
    """The device peak with activation checkpointing when only that makes ``p`` fit (a layout
    that runs here, without checkpointing, short of memory on the device alone); else 0."""
    if (p.blocking or p.memory_fits or not p.checkpointed_total or p.checkpointed_total > p.device_bytes
            or p.memory.total <= p.device_bytes or any(n.startswith(("host", "NVMe")) for n in p.notes)):
        return 0
    return p.checkpointed_total


def _secs(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _ranked(con: Any, r: Report) -> None:
    from rich.table import Table

    t = Table(title=f"per device, ranked (GB = 1e9 bytes); {ACCOUNTING_VIEW[r.accounting]}",
              title_justify="left")
    for col in ("#", "strategy", "fits", "runs", "total", "free", "activations", "host/NVMe",
                "comm/step", "step", "notes"):
        t.add_column(col, justify="right" if col not in ("strategy", "notes", "fits", "runs") else "left")
    for i, p in enumerate(r.plans, 1):
        name = p.strategy + (" *" if p.strategy == r.recommendation.strategy else "")
        fits, runs = _columns(p)
        if p.blocking:
            notes = f"cannot run on {r.world_size} device(s): " + "; ".join([*p.blocking, *p.notes])
        else:
            ckpt = checkpointing_fits(p)
            notes = "; ".join([*([f"fits with checkpointing ({gb(ckpt)})"] if ckpt else []),
                               *p.problems, *p.notes])
        if (p.tp > 1 or p.pp > 1) and not p.blocking:
            notes = f"tp={p.tp} pp={p.pp} dp={p.dp}; " + notes
        off = p.memory.host + p.memory.nvme
        planned = not p.blocking  # (a layout that cannot run here has no numbers to show)
        t.add_row(str(i), name, fits, runs, gb(p.memory.total) if planned else "-",
                  gb(p.spare) if p.memory_fits and planned else "-",
                  gb(p.memory.activations) if planned else "-", gb(off) if off and planned else "-",
                  gb(p.communication.bytes_per_step) if planned else "-",
                  _secs(p.step_seconds) if planned else "-",
                  notes[:70] + ("..." if len(notes) > 70 else ""))
    con.print(t)
    rec = r.recommendation
    con.print(f"[bold]recommendation:[/] {rec.strategy or 'none'} -- {rec.reason}")


def _columns(p: Plan) -> tuple[str, str]:
    """The table's two verdicts, apart: memory (yes, tight, no; '-' when the layout cannot run
    here at all) and whether it runs (yes, no, incomplete: a setting it needs is unset, planned
    only)."""
    if p.blocking:
        return "-", "[red]no[/]"
    fits = ("[yellow]tight[/]" if p.memory_fits and p.margin < p.reserve else "[green]yes[/]"
            if p.memory_fits else "[red]no[/]")
    runs = ("[yellow]incomplete[/]" if p.missing else "planned only" if p.planned_only
            else "[green]yes[/]")
    return fits, runs


def _breakdown(con: Any, p: Plan, accounting: str = "actual") -> None:
    from rich.table import Table

    m = p.memory
    t = Table(title=f"{p.label or p.strategy}: memory per device; {ACCOUNTING_VIEW[accounting]}", title_justify="left")
    for col in ("category", "GB", "GiB", "where"):
        t.add_column(col, justify="left" if col in ("category", "where") else "right")
    ckpt = {"selective": "selectively checkpointed"}.get(
        p.activation_checkpointing, "checkpointed" if p.activation_checkpointing else "no checkpointing")
    other = p.activations_full if p.activation_checkpointing else p.activations_checkpointed
    rows = [("parameters", m.params), ("gradients", m.grads), ("fp32 master", m.master),
            ("optimizer moments", m.optimizer),
            (f"activations ({ckpt}; other: {gb(other)})", m.activations),
            ("buffers (buckets, gathered units)", m.buffers),
            ("loss backward (fp32 log-softmax and logits gradients)", m.loss)]
    for name, v in rows:
        t.add_row(name, f"{v / GB:,.2f}", f"{v / GiB:,.2f}", "device")
    t.add_row("activations gone: end of backward, optimizer step", f"{m.step / GB:,.2f}",
              f"{m.step / GiB:,.2f}", "device")
    t.add_row("[bold]peak on device[/] (the larger phase)", f"{m.total / GB:,.2f}", f"{m.total / GiB:,.2f}",
              f"of {gb(p.device_bytes)}")
    if m.host:
        t.add_row("offloaded to host", f"{m.host / GB:,.2f}", f"{m.host / GiB:,.2f}", "host")
        for name, v in m.host_items.items():  # planner/host.py's items (process: not in the sum)
            t.add_row(f"  {name}", f"{v / GB:,.2f}", f"{v / GiB:,.2f}", "host")
    if m.nvme:
        t.add_row("offloaded to NVMe", f"{m.nvme / GB:,.2f}", f"{m.nvme / GiB:,.2f}", "nvme")
    con.print(t)
    c = Table(title="communication per optimizer step, per rank", title_justify="left")
    for col in ("collective", "group", "ranks", "sent", "time", "overlaps"):
        c.add_column(col, justify="right" if col in ("ranks", "sent", "time") else "left")
    for name, x in p.communication.by_collective.items():
        c.add_row(name + (" (per micro-batch)" if x.per_micro else ""), x.group, str(x.ranks),
                  gb(x.bytes), _secs(x.seconds), x.overlap)
    con.print(c)
    seq = "".join(f" {k}={getattr(p, k)}" for k in ("cp", "sp", "ep") if getattr(p, k) > 1)
    con.print(f"layout: tp={p.tp} pp={p.pp} dp={p.dp}{seq} shard group={p.shard}, "
              f"{p.microbatches} micro-batch(es) per step")
    optimizer = f", optimizer step {_secs(p.optimizer_seconds)}" if p.optimizer_seconds else ""
    optimizer += f", engine's own work {_secs(p.engine_seconds)}" if p.engine_seconds else ""
    optimizer += f", at least {_secs(p.floor_seconds)} (launch overhead)" if p.floor_seconds else ""
    con.print(f"compute {_secs(p.compute_seconds)}, exposed communication "
              f"{_secs(p.exposed_seconds)}{optimizer}, bubble {p.bubble_fraction:.1%}: "
              f"step ~ {_secs(p.step_seconds)}")
    for line in [*p.problems, *p.notes]:
        con.print(f"[yellow]note:[/] {line}")
    con.print(("[green]" if p.fits and not p.problems else "[red]") + p.message() + "[/]")
