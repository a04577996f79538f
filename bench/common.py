"""What every benchmark shares: one train.py run, the hand-written loop's run, medians and
spreads, the machine's description, and rewriting one table of BENCHMARKS.md in place.

Every comparison is a ratio measured in the same invocation, the two sides alternating, the
median over repetitions with its spread (min..max of the per-repetition ratios): these machines
are shared and move +-4% run to run for the same command.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"


def env(threads: int = 1) -> dict[str, str]:
    """Both sides of a comparison run with the same thread count per process (and this checkout
    importable)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def train(overrides: list[str], out: Path, *, timeout: float = 900, threads: int = 1,
          args: list[str] | None = None) -> tuple[dict | None, float, str]:
    """``python train.py <overrides>`` into ``out``: (report.json or None on failure, wall
    seconds of the whole command, stderr tail)."""
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, "callbacks.progress_bar=false",
           f"hydra.run.dir={out}", *(args or [])]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=env(threads),
                          timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not (out / "report.json").exists():
        return None, wall, (proc.stderr or proc.stdout)[-2000:]
    return json.loads((out / "report.json").read_text()), wall, ""


def hand(family: str, model: str, out: Path, *, devices: int, steps: int, global_batch: int,
         micro_batch: int, grad_clip: float = 1.0, timeout: float = 900,
         threads: int = 1) -> dict | None:
    """The hand-written loop (bench/handloop.py) under torchrun; its JSON or None."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={devices}", str(ROOT / "bench" / "handloop.py"),
           f"--family={family}", f"--model={model}", f"--steps={steps}",
           f"--global-batch={global_batch}", f"--micro-batch={micro_batch}",
           f"--grad-clip={grad_clip}", f"--out={out / 'hand.json'}"]
    e = env(threads)
    if family.startswith("zero"):
        e["DS_ACCELERATOR"] = "cpu"
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, env=e, timeout=timeout)
    if proc.returncode != 0 or not (out / "hand.json").exists():
        print(f"# hand {family}: failed ({proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads((out / "hand.json").read_text())


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fmt_ratio(values: list[float]) -> str:
    """``1.01 (0.98-1.04, n=3)``: the median and the spread of per-repetition ratios."""
    if not values:
        return "–"
    m, lo, hi = median_spread(values)
    return f"{m:.2f} ({lo:.2f}-{hi:.2f}, n={len(values)})" if len(values) > 1 else f"{m:.2f} (n=1)"


def machine() -> str:
    """One line: CPU count, load averages when measured, torch version, the host's CPU name."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, torch {torch.__version__}, load avg {load}"


def header(command: str, notes: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"`{command}` — {now}; {machine()}.\n{notes}\n"


def write_section(name: str, text: str, path: Path = BENCHMARKS) -> None:
    """Replace what lies between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` in
    BENCHMARKS.md (appended at the end the first time)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{text.rstrip()}\n{end}"
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    doc = pattern.sub(lambda _: block, doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + block + "\n"
    path.write_text(doc)


def emit(name: str, command: str, notes: str, table: str, *, smoke: bool) -> None:
    """Print the table; outside smoke mode also write it into BENCHMARKS.md."""
    text = header(command, notes) + "\n" + table
    print(text)
    if not smoke:
        write_section(name, text)
        print(f"(written to {BENCHMARKS.name}, section bench:{name})", file=sys.stderr)


def command_line() -> str:
    return "python -m bench " + " ".join(sys.argv[1:])
