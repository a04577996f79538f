"""How long a job takes to start, and which heavy libraries it loads.

    python -m bench startup            # single, ddp, fsdp, zero2 on both backends, 2 repetitions
    python -m bench startup --smoke    # single on Lightning, gpt_nano, once; nothing written

Per preset and backend:
- ``--cfg job``: wall time of ``python train.py strategy=<p> backend=<b> --cfg job`` (compose and
  print only), and the heavy libraries its ``python -X importtime`` list shows (expected: none);
- command -> first step: from starting ``python train.py ...`` (gpt_nano, 1 step; 2 processes
  for every preset but single) to the last rank's first optimizer step, and the heavy libraries
  loaded by then (bench/firststep.py: a global optimizer step hook records ``sys.modules``).
A DeepSpeed preset should be the only one loading ``deepspeed``; ``logger=wandb`` the only one
loading ``wandb``; nothing here needs ``transformers`` or the SageMaker SDK.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.firststep import HEAVY

PRESETS = ["single", "ddp", "fsdp", "zero2"]
BACKENDS = ["lightning", "accelerate"]


def _overrides(preset: str, backend: str, extra: list[str]) -> list[str]:
    devices = 1 if preset == "single" else 2
    return [f"strategy={preset}", f"backend={backend}", "model=gpt_nano", "data=synthetic",
            f"cluster.devices={devices}", "cluster.accelerator=cpu", "trainer.max_steps=1",
            "trainer.global_batch_size=4", f"trainer.micro_batch_size={4 // devices}",
            "callbacks=none", *extra]


def cfg_job(preset: str, backend: str, extra: list[str]) -> tuple[float, list[str]]:
    """Wall time of ``--cfg job`` and the heavy top-level packages its import list holds."""
    cmd = [sys.executable, "-X", "importtime", str(common.ROOT / "train.py"),
           *_overrides(preset, backend, extra), "--cfg", "job"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, check=False, env=common.env(), timeout=300)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"--cfg job failed: {proc.stderr[-1500:]}")
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    return wall, [m for m in HEAVY if m in imported]


def first_step(preset: str, backend: str, extra: list[str], tmp: Path) -> tuple[float | None, list[str]]:
    out = tmp / "marks"
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.json"):
        f.unlink()
    env = {**common.env(), "BENCH_OUT": str(out), "WANDB_SILENT": "true"}
    cmd = [sys.executable, str(common.ROOT / "bench" / "firststep.py"), str(common.ROOT / "train.py"),
           *_overrides(preset, backend, extra), "callbacks.progress_bar=false", f"hydra.run.dir={tmp / 'run'}"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, check=False, env=env, timeout=600)
    marks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or not marks:
        print(f"# {preset}/{backend}: failed ({proc.returncode})\n{proc.stderr[-1500:]}", file=sys.stderr)
        return None, []
    loaded = sorted({m for mark in marks for m in mark["loaded"]}, key=HEAVY.index)
    return max(m["t"] for m in marks) - t0, loaded


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--backends", nargs="+", default=BACKENDS)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-wandb", action="store_true", help="skip the logger=wandb row")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    rows = [(pr, b, []) for pr in a.presets for b in a.backends]
    if not a.no_wandb:
        rows.append(("single", "lightning", ["logger=wandb"]))
    if a.smoke:
        a.reps, rows = 1, [("single", "lightning", [])]

    cfg_t: dict[int, list[float]] = {}
    first_t: dict[int, list[float]] = {}
    heavy: dict[int, tuple[list[str], list[str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            order = list(enumerate(rows))
            for i, (preset, backend, extra) in order[::-1] if rep % 2 else order:
                wall, cfg_heavy = cfg_job(preset, backend, extra)
                t, run_heavy = first_step(preset, backend, extra, Path(tmp) / f"{rep}-{i}")
                cfg_t.setdefault(i, []).append(wall)
                if t is not None:
                    first_t.setdefault(i, []).append(t)
                heavy[i] = (cfg_heavy, run_heavy)
            print(f"# repetition {rep + 1}/{a.reps}: done", flush=True)

    def cell(xs: list[float] | None) -> str:
        if not xs:
            return "failed"
        return f"{statistics.median(xs):.1f} s ({min(xs):.1f}-{max(xs):.1f})" if len(xs) > 1 else f"{xs[0]:.1f} s"

    lines = ["| preset | backend | extra | `--cfg job` wall | heavy imports in `--cfg job` | command -> first optimizer step "
             "| heavy libraries loaded at the first step |", "|---|---|---|---|---|---|---|"]
    for i, (preset, backend, extra) in enumerate(rows):
        cfg_heavy, run_heavy = heavy[i]
        lines.append(f"| {preset} | {backend} | {' '.join(extra) or '–'} | {cell(cfg_t.get(i))} | "
                     f"{', '.join(cfg_heavy) or 'none'} | {cell(first_t.get(i))} | {', '.join(run_heavy) or 'none'} |")
    notes = (f"gpt_nano, 1 step, synthetic tokens, `callbacks=none`; 2 CPU processes except `single`; "
             f"{a.reps} alternating repetitions, median (min-max). Heavy libraries looked for: "
             f"{', '.join(HEAVY)} (`-X importtime` for `--cfg job`; `sys.modules` of every rank at its "
             "first optimizer step for the run).")
    common.emit("startup", common.command_line(), notes, "\n".join(lines), smoke=a.smoke)
