"""Long context: per-rank saved activations and step time against the sequence length, for one
process, Ulysses over 2 ranks and context parallelism over 2 ranks, next to the planner's
prediction for the same run.

    python -m bench longcontext                       # gpt_nano, seq 1k .. 16k
    python -m bench longcontext --seqs 1024 4096
    python -m bench longcontext --smoke               # seq 128, one process; nothing written

Each point is ``train.py`` on gpt_nano (data=synthetic, one sample per step, 3 steps, fp32):
measured activations are what rank 0 saves for backward (observers/memory.py), the prediction
is the planner's (``memory.predicted.activations`` of the run's own report). cp 2 is torch's
ring attention (fsdp_cp), on CPU through parallel/context_parallel.py.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import common

SEQS = [1024, 2048, 4096, 8192, 16384]
LAYOUTS = {"single": ("strategy=single",), "ulysses 2": ("strategy=ulysses", "cluster.devices=2"),
           "cp 2": ("strategy=fsdp_cp", "cluster.devices=2")}


def _base(seq: int) -> list[str]:
    return ["model=gpt_nano", f"model.seq_len={seq}", "model.dropout=0", "data=synthetic",
            "trainer.max_steps=3", "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
            "trainer.optimizer=sgd", "trainer.lr=0.01", "trainer.warmup_steps=0", "trainer.precision=32",
            "cluster.accelerator=cpu", "planner.enforce=false", "trainer.save_last=false"]


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench longcontext")
    ap.add_argument("--seqs", type=int, nargs="+", default=SEQS)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    seqs = [128] if a.smoke else a.seqs
    layouts = {"single": LAYOUTS["single"]} if a.smoke else LAYOUTS
    rows = ["| seq | layout | activations / rank, measured (MiB) | predicted (MiB) | measured / predicted "
            "| step (s), measured |", "|---:|---|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqs:
            for name, overrides in layouts.items():
                out = Path(tmp) / f"{name.replace(' ', '_')}-{seq}"
                report, _, err = common.train([*_base(seq), *overrides], out)
                if report is None:
                    rows.append(f"| {seq} | {name} | failed | | | |")
                    print(err)
                    continue
                measured = report["memory"]["ranks"][0]["activations"]
                predicted = report["memory"]["predicted"]["activations"]
                rows.append(f"| {seq} | {name} | {_mib(measured)} | {_mib(predicted)} | "
                            f"{measured / predicted:.2f} | {report['throughput']['step_seconds']:.3f} |")
    notes = ("gpt_nano (dim 32, 2 layers, 4 heads / 2 KV heads), data=synthetic, micro batch 1, fp32, "
             "3 steps; activations: what rank 0 saves for backward (observers/memory.py), "
             "predicted: the planner's for the same run; step: median after the first; 2 ranks "
             "share the 2 cores. cp 2: torch's ring attention (fsdp_cp; on CPU through "
             "parallel/context_parallel.py).")
    common.emit("longcontext", common.command_line(), notes, "\n".join(rows), smoke=a.smoke)
