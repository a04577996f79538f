"""Every CPU preset side by side: step time, model-state bytes per rank, collective payload per
step, on both backends (this replaces bench/strategies.py and bench/observers.py).

    python -m bench presets                     # every CPU preset, gpt_small, 2 processes
    python -m bench presets --presets ddp fsdp2 zero3 --steps 6
    python -m bench presets --smoke             # ddp on Lightning, gpt_nano, 2 steps; nothing written

Each preset runs through the real CLI (train.py, default observers) on synthetic tokens.
Step time is report.json's median step (the first excluded) and its ratio to the ``ddp`` row of
the same backend in the same invocation; state bytes are what rank 0 really held (params +
grads + optimizer, from live tensors); the payload is what the communication observer counted
per step (all collectives, both directions summed as torch reports them). A preset a backend
refuses before launch is listed with the reason.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import common

# Presets that run on 2 CPU processes (PLATFORM.md): the 2-D ones (hsdp2, fsdp_hybrid, fsdp_tp,
# 3d, pp_dp) need 4, fsdp_offload and zero_infinity need a GPU / libaio, ddp_bf16_compress NCCL.
CPU_PRESETS = ["ddp", "ddp_fp16_compress", "ddp_powersgd", "fsdp", "fsdp_grad_op", "fsdp2",
               "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "tp", "pipeline"]
BACKENDS = ["lightning", "accelerate"]
# Presets whose step is cut differently: TP has one data-parallel replica (the whole global
# batch per step), a 2-stage pipeline runs 4 micro-batches per schedule.
MICRO = {"tp": lambda g, d: g, "pipeline": lambda g, d: g // 4}


def _row(report: dict) -> tuple[float, int, float]:
    ranks = report["memory"]["ranks"]
    state = max(r.get("params", 0) + r.get("grads", 0) + r.get("optimizer", 0) for r in ranks)
    payload = sum(c.get("bytes", 0) for c in report.get("communication", {}).get("per_step", {}).values())
    return report["throughput"]["step_seconds"], state, payload


def _refusal(err: str) -> str:
    lines = [ln.strip() for ln in err.splitlines() if ln.strip() and "Traceback" not in ln]
    hit = [ln for ln in lines if "accelerate" in ln.lower() or "refuse" in ln.lower() or "cannot" in ln.lower()]
    return (hit or lines or ["?"])[0][:160].replace("|", "/")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench presets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=CPU_PRESETS)
    p.add_argument("--backends", nargs="+", default=BACKENDS)
    p.add_argument("--model", default="gpt_small")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.presets, a.backends, a.model, a.steps = ["ddp"], ["lightning"], "gpt_nano", 2
    presets = ["ddp"] + [x for x in a.presets if x != "ddp"]

    results: dict[tuple[str, str], tuple | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in presets:
            for backend in a.backends:  # the two backends alternate within each preset
                micro = MICRO.get(preset, lambda g, d: g // d)(a.global_batch, a.devices)
                report, _, err = common.train(
                    [f"strategy={preset}", f"backend={backend}", f"model={a.model}", "data=synthetic",
                     f"cluster.devices={a.devices}", "cluster.accelerator=cpu", f"trainer.max_steps={a.steps}",
                     f"trainer.global_batch_size={a.global_batch}", f"trainer.micro_batch_size={micro}",
                     "trainer.warmup_steps=0", "planner.enforce=false", "callbacks.plots=false"],
                    Path(tmp) / f"{preset}-{backend}", timeout=a.timeout)
                results[(preset, backend)] = _row(report) if report else f"refused or failed: {_refusal(err)}"
                print(f"# {preset}/{backend}: {results[(preset, backend)]}", flush=True)

    lines = ["| preset | backend | step (s) | step vs ddp | state bytes per rank | collective payload per step |",
             "|---|---|---|---|---|---|"]
    for preset in presets:
        for backend in a.backends:
            r = results[(preset, backend)]
            if isinstance(r, str):
                lines.append(f"| {preset} | {backend} | {r} | | | |")
                continue
            base = results.get(("ddp", backend))
            vs = f"{r[0] / base[0]:.2f}" if isinstance(base, tuple) and base[0] else "–"
            lines.append(f"| {preset} | {backend} | {r[0]:.3f} | {vs} | {r[1] / 2**20:.1f} MiB | "
                         f"{r[2] / 2**20:.2f} MiB |")
    notes = (f"{a.model}, {a.devices} CPU processes (gloo) x 1 thread, synthetic tokens, global batch "
             f"{a.global_batch}, fp32, {a.steps} steps, default observers (plots off), one run per cell: "
             "step times of single runs move +-10% on this shared machine, bytes do not. "
             "Not here: the presets that need 4 processes (hsdp2, fsdp_hybrid, fsdp_tp, 3d, pp_dp), a GPU "
             "(fsdp_offload), NVMe/libaio (zero_infinity) or NCCL (ddp_bf16_compress).")
    common.emit("presets", common.command_line(), notes, "\n".join(lines), smoke=a.smoke)
