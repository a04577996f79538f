"""How step time and per-rank memory grow with the model and the world, measured next to the
planner's prediction for the same run, and a PNG plot.

    python -m bench scaling                   # gpt_nano, gpt_small, gpt_125m x 1, 2, 4 processes
    python -m bench scaling --strategy ddp --steps 4
    python -m bench scaling --smoke           # gpt_nano x 1 process, 2 steps; nothing written

Every run is ``train.py`` with the default observers at a fixed global batch (so a larger world
means fewer samples per rank) and ``cluster.oversubscribe=true`` (4 processes on a 2-core machine
share cores: step time then measures the machine, not the strategy; the planner does not know
that). Predicted and measured come from the run's own report.json: ``plan.step_seconds`` next
to the median step, and ``predicted_vs_measured`` (model states + activations per rank).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import common

MODELS = ["gpt_nano", "gpt_small", "gpt_125m"]
WORLDS = [1, 2, 4]
PLOT = common.ROOT / "docs" / "scaling.png"


def _point(report: dict) -> dict:
    pvm = report["predicted_vs_measured"]
    return {"step": report["throughput"]["step_seconds"], "step_pred": report["plan"]["step_seconds"],
            "mem": pvm["state_bytes"]["measured"] + pvm["activations"]["measured"],
            "mem_pred": pvm["state_bytes"]["predicted"] + pvm["activations"]["predicted"],
            "rss": max(r["peak_rss"] for r in report["memory"]["ranks"])}


def plot(points: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for i, model in enumerate(sorted({m for m, _ in points}, key=lambda m: MODELS.index(m) if m in MODELS else 9)):
        ws = sorted(w for m, w in points if m == model)
        color = f"C{i}"
        pts = [points[(model, w)] for w in ws]
        ax_t.plot(ws, [p["step"] for p in pts], "o-", color=color, label=f"{model} measured")
        ax_t.plot(ws, [p["step_pred"] for p in pts], "x--", color=color, label=f"{model} planner")
        ax_m.plot(ws, [p["mem"] / 2**20 for p in pts], "o-", color=color, label=f"{model} measured")
        ax_m.plot(ws, [p["mem_pred"] / 2**20 for p in pts], "x--", color=color, label=f"{model} planner")
    for ax, label in ((ax_t, "step time (s)"), (ax_m, "states + activations per rank (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("processes")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--worlds", nargs="+", type=int, default=WORLDS)
    p.add_argument("--strategy", default="fsdp2", help="the preset (world 1 runs it on one process)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="gpt_125m's sequence length (2048 is minutes a step on CPU)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.models, a.worlds, a.steps = ["gpt_nano"], [1], 2

    points: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            for world in a.worlds:
                extra = [f"model.seq_len={a.seq_len}"] if model == "gpt_125m" else []
                report, _, err = common.train(
                    [f"strategy={a.strategy}", f"model={model}", *extra, "data=synthetic",
                     f"cluster.devices={world}", "cluster.accelerator=cpu", "cluster.oversubscribe=true",
                     f"trainer.max_steps={a.steps}", f"trainer.global_batch_size={a.global_batch}",
                     f"trainer.micro_batch_size={a.global_batch // world}", "trainer.warmup_steps=0",
                     "planner.enforce=false", "callbacks.plots=false"],
                    Path(tmp) / f"{model}-{world}", timeout=a.timeout)
                if report is None:
                    print(f"# {model} x {world}: failed\n{err}", flush=True)
                    continue
                points[(model, world)] = _point(report)
                print(f"# {model} x {world}: {points[(model, world)]}", flush=True)
        title = (f"{a.strategy}, global batch {a.global_batch}, {a.steps} steps, CPU gloo, "
                 f"{common.machine()}")
        plot_path = Path(tmp) / "scaling.png" if a.smoke else PLOT
        if points:
            plot(points, plot_path, title)

    lines = ["| model | processes | step (s) measured | planner | per-rank states + activations measured | "
             "planner | ratio | peak RSS per rank |", "|---|---|---|---|---|---|---|---|"]
    for (model, world), pt in points.items():
        lines.append(f"| {model} | {world} | {pt['step']:.3f} | {pt['step_pred']:.4f} | "
                     f"{pt['mem'] / 2**20:.1f} MiB | {pt['mem_pred'] / 2**20:.1f} MiB | "
                     f"{pt['mem'] / pt['mem_pred']:.3f} | {pt['rss'] / 2**20:.0f} MiB |")
    notes = (f"`strategy={a.strategy}`, fixed global batch {a.global_batch}, fp32, {a.steps} steps, one run "
             f"per point, gpt_125m at seq_len {a.seq_len}; CPU processes x 1 thread, oversubscribed at 4 on 2 "
             "cores. The planner's step time assumes `cluster.peak_tflops` (0.2 for this machine, a rough "
             "order of magnitude) and knows nothing of oversubscription; its memory is the per-rank model "
             f"states + activations. Plot: [docs/scaling.png](docs/scaling.png).")
    common.emit("scaling", common.command_line(), notes, "\n".join(lines), smoke=a.smoke)
