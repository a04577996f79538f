"""Compare strategies in one run: same model, global batch, data and seed; ratios against ddp.

    python bench/strategies.py                       # every CPU preset, 2 processes, gpt_small
    python bench/strategies.py --presets ddp fsdp zero3 --steps 20 --model gpt_nano
    python bench/strategies.py --accelerator gpu --devices 8     # on a GPU node

Each preset runs through the real CLI (train.py) on synthetic tokens; the table reports
throughput and the bytes each rank held (from report.json), as ratios to the ddp row measured
in the same invocation — absolute numbers depend on the machine, ratios much less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_PRESETS = ["ddp", "ddp_fp16_compress", "ddp_powersgd", "fsdp", "fsdp_grad_op", "fsdp2",
               "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "tp", "pipeline"]
# Presets whose step is cut differently: TP has one data-parallel replica (the whole global
# batch per step), a 2-stage pipeline runs 4 micro-batches per schedule.
MICRO = {"tp": lambda a: a.global_batch, "pipeline": lambda a: a.global_batch // 4}


def run(preset: str, args: argparse.Namespace, out: Path) -> dict | None:
    cmd = [sys.executable, str(ROOT / "train.py"), f"strategy={preset}", f"model={args.model}",
           "data=synthetic", f"cluster.devices={args.devices}", f"cluster.accelerator={args.accelerator}",
           f"trainer.max_steps={args.steps}", f"trainer.global_batch_size={args.global_batch}",
           f"trainer.micro_batch_size={MICRO.get(preset, lambda a: a.global_batch // a.devices)(args)}",
           "trainer.warmup_steps=0", "callbacks.progress_bar=false", "planner.enforce=false",
           *args.extra, f"hydra.run.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        print(f"# {preset}: failed ({proc.returncode})\n{proc.stderr[-1500:]}", file=sys.stderr)
        return None
    return json.loads((out / "report.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=CPU_PRESETS)
    p.add_argument("--model", default="gpt_small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    args = p.parse_args()
    presets = ["ddp"] + [x for x in args.presets if x != "ddp"]

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in presets:
            report = run(name, args, Path(tmp) / name)
            if report is not None:
                rows[name] = report
                print(f"# {name}: {report['tokens_per_second']:.0f} tok/s", file=sys.stderr)
    if "ddp" not in rows:
        sys.exit("the ddp baseline failed; no ratios")
    base = rows["ddp"]

    def held(r: dict, key: str) -> int:
        return max(rank.get(key, 0) for rank in r["memory"]["ranks"])

    def total(r: dict) -> int:
        return held(r, "params") + held(r, "grads") + held(r, "optimizer")

    print(f"model={args.model} devices={args.devices} accelerator={args.accelerator} "
          f"global_batch={args.global_batch} steps={args.steps} (synthetic data)\n")
    print("| preset | tok/s vs ddp | params held | grads held | optimizer held | states vs ddp | "
          "peak RSS vs ddp | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        rss = max(rank["peak_rss"] for rank in r["memory"]["ranks"])
        base_rss = max(rank["peak_rss"] for rank in base["memory"]["ranks"])
        print(f"| {name} | {r['tokens_per_second'] / base['tokens_per_second']:.2f} | "
              f"{held(r, 'params') / 2**20:.1f} MiB | {held(r, 'grads') / 2**20:.1f} MiB | "
              f"{held(r, 'optimizer') / 2**20:.1f} MiB | {total(r) / total(base):.2f} | "
              f"{rss / base_rss:.2f} | {r['final_loss']:.4f} |")


if __name__ == "__main__":
    main()
