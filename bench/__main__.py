"""Run one benchmark: ``python -m bench <name> [--smoke] [options]``.

    overhead   our layer against hand-written torch / DeepSpeed loops, observers' cost
    startup    command -> first optimizer step; which heavy libraries a job imports
    presets    step time, state bytes and collective payload of every CPU preset
    scaling    step time and memory vs model size and world size, next to the planner
    gpu        MFU, memory predicted vs measured, the largest zero3_offload model (GPU only)
    steptime   predicted vs measured step time after planner.calibrate=true (CPU presets)
    longcontext  activations per rank and step time vs sequence length: single, ulysses 2, cp 2
    moe        mixture of experts vs ep: assignments per expert, drops, all-to-all bytes vs planned

Each writes its table into BENCHMARKS.md (between ``<!-- bench:<name> -->`` markers), except
with ``--smoke`` (tiny, seconds, nothing written: what tests/test_bench.py runs).
``python -m bench all --smoke`` runs every smoke mode in this one process.
"""

from __future__ import annotations

import importlib
import sys

NAMES = ["overhead", "startup", "presets", "scaling", "gpu", "longcontext", "moe", "steptime"]


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in NAMES + ["all"]:
        sys.exit(f"usage: python -m bench {{{'|'.join(NAMES)}|all}} [--smoke] [options]\n\n{__doc__}")
    name, rest = argv[0], argv[1:]
    for one in NAMES if name == "all" else [name]:
        print(f"## bench {one}", flush=True)
        importlib.import_module(f"bench.{one}").main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
