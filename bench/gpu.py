"""The GPU figures, in one call of under 10 minutes on one GPU machine:

    python -m bench gpu                 # needs CUDA
    python -m bench gpu --smoke         # CPU, gpt_nano, fp32: only proves the script runs

1. MFU and tokens/s of ``llama_1b`` shapes on one GPU in bf16, ``single`` and ``fsdp2`` (world 1),
   activation checkpointing off and on (report.json -> throughput; goal >= 45% MFU).
2. Peak memory predicted vs measured for the same runs: the planner's per-device total
   (``memory.predicted.total``) next to the largest ``torch.cuda.max_memory_allocated`` of any
   phase (goal: within +-10%).
3. The largest model ``zero3_offload`` trains on this one GPU with its host memory: the planner
   (``plan.py ... planner.format=json``) is asked for each model in ``--ladder``, and the
   largest it says fits is trained for a few steps (goal >= 7B parameters).

The cluster is described from what the machine has (device memory from torch, host memory from
psutil) with ``cluster.peak_tflops`` from the throughput observer's table for the GPU's name.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import common

LADDER = ["llama_1b", "llama_7b", "llama_13b", "llama_70b"]


def _cluster(smoke: bool) -> list[str]:
    if smoke:
        return ["cluster.accelerator=cpu", "cluster.devices=1"]
    import psutil
    import torch

    from observers.throughput import device_peak_tflops

    mem = torch.cuda.get_device_properties(0).total_memory / 1e9
    host = psutil.virtual_memory().total / 1e9
    peak = device_peak_tflops("bf16-mixed") or 989.0
    return ["cluster.accelerator=gpu", "cluster.devices=1", f"cluster.device_memory_GB={mem:.0f}",
            f"cluster.host_memory_GB={host:.0f}", f"cluster.peak_tflops={peak}"]


def _mfu_rows(a: argparse.Namespace, cluster: list[str], tmp: Path) -> list[str]:
    lines = ["| strategy | act. ckpt | tokens/s | MFU | TFLOP/s | peak allocated | planner | measured / planner |",
             "|---|---|---|---|---|---|---|---|"]
    variants = [("single", False)] if a.smoke else [(s, ac) for s in ("single", "fsdp2") for ac in (False, True)]
    for strategy, ac in variants:
        report, _, err = common.train(
            [f"strategy={strategy}", f"model={a.model}", "data=synthetic", *cluster,
             f"trainer.precision={a.precision}", f"strategy.activation_checkpointing={str(ac).lower()}",
             f"trainer.max_steps={a.steps}", f"trainer.global_batch_size={a.micro}",
             f"trainer.micro_batch_size={a.micro}", "trainer.warmup_steps=0", "planner.enforce=false",
             "callbacks.communication=false", "callbacks.plots=false"],
            tmp / f"{strategy}-{ac}", timeout=a.timeout, threads=4)
        if report is None:
            lines.append(f"| {strategy} | {ac} | failed: {err.strip().splitlines()[-1][:120] if err.strip() else '?'} | | | | | |")
            continue
        tp = report["throughput"]
        rank = report["memory"]["ranks"][0]
        peak = max((p["allocated"] for p in rank.get("cuda", {}).values()), default=0)
        pred = report["memory"].get("predicted", {}).get("total", 0)
        mfu = f"{100 * tp['mfu']:.1f}%" if tp.get("mfu") else "–"
        ratio = f"{peak / pred:.2f}" if peak and pred else "–"
        lines.append(f"| {strategy} | {ac} | {tp['tokens_per_second']:.0f} | {mfu} | "
                     f"{tp['tflops_per_second']:.1f} | {peak / 2**30:.2f} GiB | {pred / 2**30:.2f} GiB | {ratio} |")
        print(lines[-1], flush=True)
    return lines


def _plan(model: str, cluster: list[str], a: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(common.ROOT / "plan.py"), f"model={model}", "strategy=zero3_offload", *cluster,
           f"trainer.precision={a.precision}", "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
           "strategy.activation_checkpointing=true", "planner.format=json"]
    proc = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, check=False, env=common.env(), timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"plan.py {model}: {proc.stderr[-800:]}")
    return json.loads(proc.stdout[proc.stdout.index("{"):])["plans"][0]


def _largest(a: argparse.Namespace, cluster: list[str], tmp: Path) -> list[str]:
    fits = []
    for model in a.ladder:
        plan = _plan(model, cluster, a)
        print(f"# planner: {model} zero3_offload fits={plan['fits']} "
              f"device {plan['memory']['total'] / 1e9:.1f} GB host {plan['memory']['host'] / 1e9:.1f} GB", flush=True)
        if plan["fits"]:
            fits.append((model, plan))
    if not fits:
        return ["The planner finds no model of the ladder that fits with zero3_offload here."]
    model, plan = fits[-1]
    report, wall, err = common.train(
        ["strategy=zero3_offload", f"model={model}", "data=synthetic", *cluster,
         f"trainer.precision={a.precision}", "strategy.activation_checkpointing=true",
         f"trainer.max_steps={a.offload_steps}", "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
         "trainer.warmup_steps=0", "callbacks.communication=false", "callbacks.plots=false"],
        tmp / "largest", timeout=a.offload_timeout, threads=8)
    result = (f"trained {report['steps']} steps, losses {[round(x, 3) for x in report['losses']]}, "
              f"{report['throughput']['tokens_per_second']:.0f} tokens/s, {wall:.0f} s wall"
              if report else f"FAILED: {err.strip().splitlines()[-1][:200] if err.strip() else '?'}")
    return [f"Largest model the planner fits with `zero3_offload` on this GPU (ladder {', '.join(a.ladder)}): "
            f"**{model}** (planner: {plan['memory']['total'] / 1e9:.1f} GB on the device, "
            f"{plan['memory']['host'] / 1e9:.1f} GB on the host); {result}."]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama_1b")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--micro", type=int, default=4, help="micro batch = global batch (world 1)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timeout", type=float, default=110, help="seconds per MFU run")
    p.add_argument("--ladder", nargs="+", default=LADDER)
    p.add_argument("--offload-steps", type=int, default=3)
    p.add_argument("--offload-timeout", type=float, default=300)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.model, a.precision, a.micro, a.steps, a.ladder, a.offload_steps = "gpt_nano", "32", 2, 2, ["gpt_nano"], 1
        a.timeout = a.offload_timeout = 600  # a loaded CPU machine, not a GPU's budget
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("python -m bench gpu needs CUDA (use --smoke to check the script on CPU)")
    cluster = _cluster(a.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        rows = _mfu_rows(a, cluster, Path(tmp))
        largest = _largest(a, cluster, Path(tmp))
    notes = (f"`{a.model}` shapes, {a.precision}, micro batch {a.micro} (world 1), {a.steps} steps, "
             "median step (first excluded); communication observer off. MFU = model FLOPs / the GPU's "
             "dense peak (observers/throughput.py). Goals (issue 15): >= 45% MFU, peak memory within "
             "+-10% of the planner, zero3_offload >= 7B parameters.")
    common.emit("gpu", common.command_line(), notes, "\n".join(rows) + "\n\n" + "\n".join(largest), smoke=a.smoke)
