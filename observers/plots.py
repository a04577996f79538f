"""Plots of the run, PNG in the run directory, drawn by rank 0 from the finished report:
``loss.png`` (the loss of every optimizer step, each validation's loss on it), ``memory.png``
(bytes by category per rank, predicted beside) and ``communication.png`` (collective bytes per
step by kind and group); for a sweep, ``losses_overlay`` (every job's loss curve on one axis,
launchers/sweep.py's ``sweep_losses.png``) and ``sweep_panels`` (its ``sweep_report.png``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from observers.base import Ended, Observer, Selection, observer

CATEGORIES = ("params", "grads", "optimizer", "activations")


class Plots(Observer):
    def __init__(self, out: Path):
        self.out = out

    def on_report(self, engine: Ended, report: dict[str, Any]) -> None:
        if engine.rank != 0:
            return
        import matplotlib

        matplotlib.use("Agg")
        if report.get("losses"):
            loss_plot(report["losses"], report.get("validation") or [], self.out / "loss.png", moe=moe_run(report))
        if report.get("memory", {}).get("ranks"):
            memory_plot(report["memory"], self.out / "memory.png")
        if report.get("communication", {}).get("by_group"):
            communication_plot(report["communication"]["by_group"], self.out / "communication.png")


def moe_run(report: dict[str, Any]) -> bool:
    """Whether the run trained a mixture of experts (its train loss adds the router's aux loss)."""
    model = (report.get("config") or {}).get("model") or {}
    return bool(report.get("moe") or model.get("n_experts"))


def loss_plot(losses: list[float], validation: list[dict[str, Any]], path: Path, moe: bool = False) -> None:
    import matplotlib.pyplot as plt

    fig = loss_figure(losses, validation, moe)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def loss_figure(losses: list[float], validation: list[dict[str, Any]], moe: bool = False) -> Any:
    """``loss_plot``'s figure (the caller saves and closes it)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(losses) + 1), losses, label="train (global batch)")
    if validation:
        ax.plot([v["step"] for v in validation], [v["loss"] for v in validation], "o-",
                label="validation")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token cross entropy)" + ("\ntrain: + the MoE's aux loss" if moe else ""))
    ax.set_title("loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def losses_overlay(curves: dict[str, list[float]], path: Path) -> None:
    """Several runs' loss curves on one axis (a sweep: one line per job, labelled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, marker="." if len(losses) < 30 else None,
                label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token cross entropy)")
    _save(fig, ax, "loss of every job", path)


def _save(fig: Any, ax: Any, title: str, path: Path) -> None:
    """Title, legend, write and close: how every plot here ends."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def memory_plot(memory: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    ranks = memory["ranks"]
    bars = [(f"rank {r['rank']}", r) for r in ranks]
    predicted = memory.get("predicted")
    if predicted:
        bars.append(("predicted", {"params": predicted["params"], "grads": predicted["grads"],
                                   "optimizer": predicted["master"] + predicted["optimizer"]
                                   + predicted.get("host", 0),
                                   "activations": predicted["activations"]}))
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(bars), 4))
    bottom = [0.0] * len(bars)
    for cat in CATEGORIES:
        values = [(b[1].get(cat) or 0) / 2**20 for b in bars]  # (activations None: not counted)
        ax.bar([b[0] for b in bars], values, bottom=bottom, label=cat)
        bottom = [x + v for x, v in zip(bottom, values)]
    ax.set_ylabel("MiB")
    _save(fig, ax, "memory held per rank", path)


def communication_plot(by_group: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib.pyplot as plt

    labels = [f"{k}\n{g}" for g, kinds in by_group.items() for k in kinds]
    values = [v["bytes"] / 2**20 for kinds in by_group.values() for v in kinds.values()]
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(labels), 4))
    ax.bar(labels, values)
    ax.set_ylabel("MiB per optimizer step (payload)")
    ax.set_title("collectives per step, rank 0")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclass
class PlotsKnobs:
    plots: bool = True
    """loss.png, memory.png and communication.png in the run directory (matplotlib)."""


@observer("plots", order=80, knobs=PlotsKnobs)
def _selected(s: Selection) -> Observer | None:
    """``callbacks.plots``: loss.png, memory.png and communication.png."""
    return Plots(s.out) if s.job.callbacks.plots else None


def sweep_panels(rows: list[dict[str, Any]], path: Path) -> None:
    """launchers/sweep.py's ``sweep_report.png``, from its rows: five panels, one bar per job:
    tokens/s; model states (max over ranks) and communication per step, each measured beside
    predicted; peak memory (max over ranks); and the final loss against the measured
    communication per step, one point per job (what each byte bought)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = sweep_figure(rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_figure(rows: list[dict[str, Any]]) -> Any:
    """``sweep_panels``' figure (matplotlib's, drawn; the caller saves and closes it). Each job is
    named by the overrides that set it apart from the sweep's other jobs (its strategy when none
    do); a tokens/s bar of the whole loop's rate (callbacks.throughput off) is hatched."""
    import matplotlib.pyplot as plt

    names = job_names(rows)
    labels = [n + ("" if r["status"] == "ok" else f"\n({r['status']})") for n, r in zip(job_names(rows, "\n"), rows)]
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
    loop = [r.get("tokens_per_second_of") == "whole loop" for r in rows]
    for bar, whole in zip(axes[0].bar(x, get("tokens_per_second")), loop):
        bar.set_hatch("//" if whole else None)
    axes[0].set_title("tokens/s" + ("\n(hatched: the whole loop's, first step in)" if any(loop) else ""),
                      fontsize=10)
    for ax, (measured, predicted, title, who) in zip(axes[1:], [
            ("state_bytes_per_rank", "predicted_state_bytes", "model states per rank, MiB", "max rank"),
            ("peak_memory_per_rank", None, "peak memory per rank, MiB", None),
            ("comm_bytes_per_step", "predicted_comm_bytes_per_step", "communication per step, MiB", "rank 0")]):
        if predicted is None:
            ax.bar(x, get(measured, 2**20))
        else:
            ax.bar([i - w / 2 for i in x], get(measured, 2**20), w, label=f"measured ({who})")
            ax.bar([i + w / 2 for i in x], get(predicted, 2**20), w, label="predicted")
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
    for ax in axes[:4]:
        ax.set_xticks(list(x), labels, fontsize=7, rotation=20)
    _loss_vs_bytes(axes[4], rows, names)
    fig.tight_layout()
    return fig


def job_names(rows: list[dict[str, Any]], sep: str = " ") -> list[str]:
    """``<job>: <the overrides not every job has>`` (the strategy when every override is shared)."""
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if rows else set()
    return [f"{r['job']}: " + (sep.join(o for o in r["overrides"] if o not in common) or r["strategy"])
            for r in rows]


def _loss_vs_bytes(ax: Any, rows: list[dict[str, Any]], names: list[str]) -> None:
    """Final loss against rank 0's measured communication per step, each point named; a log axis
    only over more than a decade (within one, its minor labels overprinted each other)."""
    from matplotlib.ticker import MaxNLocator, NullFormatter

    done = [(r["comm_bytes_per_step"] / 2**20, r["final_loss"], n) for r, n in zip(rows, names)
            if r.get("final_loss") is not None and r.get("comm_bytes_per_step")]
    for mib, loss, name in done:
        ax.scatter(mib, loss)
        ax.annotate(name, (mib, loss), fontsize=7)
    if done and max(d[0] for d in done) > 10 * min(d[0] for d in done):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.xaxis.set_major_locator(MaxNLocator(3))
        ax.ticklabel_format(axis="x", style="plain", useOffset=False)
    ax.set_xlabel("communication per step, MiB (rank 0, measured)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7, labelrotation=30)
    ax.set_title("final loss vs bytes", fontsize=10)
