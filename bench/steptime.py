"""Predicted against measured step time on this machine after ``planner.calibrate=true``: the
presets single, ddp, fsdp2, zero2, zero3, tp, pipeline and the offloaded zero2_offload and
zero3_offload (issue #38) at gpt_small, 2 processes (single: 1).

    python -m bench steptime                  # 12 steps each, the median step (first excluded)
    python -m bench steptime --smoke          # gpt_nano, ddp only, 3 steps, uncalibrated; nothing written

Each run is ``train.py ... planner.calibrate=true``: the first run of a world size measures the
machine once (backends/common/calibrate.py, cached under ~/.cache/stratagem/machine) and every run's
report.json carries ``predicted_vs_measured.step_seconds``. The table goes to docs/PLANNER.md's
step-time section (between ``<!-- bench:steptime -->`` markers).
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from bench import common

PRESETS = ["single", "ddp", "fsdp2", "zero2", "zero3", "tp", "pipeline", "zero2_offload", "zero3_offload"]
DOC = common.ROOT / "docs" / "PLANNER.md"


def run(preset: str, model: str, steps: int, out: Path, calibrate: bool = True) -> dict | None:
    world = 1 if preset == "single" else 2
    report, _, err = common.train([f"model={model}", f"strategy={preset}", f"cluster.devices={world}",
                                   "cluster.accelerator=cpu", "data=synthetic", f"trainer.max_steps={steps}",
                                   f"planner.calibrate={str(calibrate).lower()}", "planner.enforce=false",
                                   "callbacks.plots=false"],
                                  out / preset, threads=1 if world > 1 else 2)
    if report is None:
        print(f"# {preset}: failed\n{err}")
        return None
    return report["predicted_vs_measured"]["step_seconds"]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench steptime")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args(argv)
    presets, model, steps = (["ddp"], "gpt_nano", 3) if a.smoke else (PRESETS, "gpt_small", a.steps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            r = run(preset, model, steps, Path(tmp), calibrate=not a.smoke)
            if r is not None:  # (uncalibrated, --smoke: the plan is the nominal peak's, no ratio)
                ratio = "– (uncalibrated)" if r["ratio"] is None else f"{r['ratio']:.2f}"
                rows.append(f"| {preset} | {r['predicted']:.3f} | {r['measured']:.3f} | {ratio} |")
                print(rows[-1], flush=True)
    table = "\n".join(["| preset | predicted (s) | measured (s) | measured / predicted |",
                       "|---|---|---|---|", *rows,
                       f"\n{common.machine()}; {model}, global batch 16, micro batch 8, fp32"])
    if not a.smoke:
        text = DOC.read_text()
        DOC.write_text(re.sub(r"(<!-- bench:steptime -->\n).*?(<!-- /bench:steptime -->)",
                              lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S))
    print(table)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
