"""What the observers cost: one preset trained with each observer set, in one run.

    python bench/observers.py                     # ddp and fsdp2, 2 processes, gpt_small
    python bench/observers.py --presets zero3 --steps 20

Rows: callbacks=none (the loss log only), the default set (memory, throughput, comparison,
plots), and the default set plus the communication profile; throughput as a ratio to the
``none`` run of the same preset.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategies import run  # noqa: E402  (bench/strategies.py: one train.py run)

SETS = {"none": ["callbacks=none"], "default": [],
        "default + communication": ["callbacks.communication=true"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["ddp", "fsdp2"])
    p.add_argument("--model", default="gpt_small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    print(f"model={args.model} devices={args.devices} steps={args.steps} (synthetic data)\n")
    print("| preset | observers | tok/s vs none |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            base = None
            for label, extra in SETS.items():
                args.extra = extra
                r = run(preset, args, Path(tmp) / f"{preset}-{label.replace(' ', '')}")
                if r is None:
                    continue
                base = base or r["tokens_per_second"]
                print(f"| {preset} | {label} | {r['tokens_per_second'] / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
