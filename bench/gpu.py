"""The GPU figures, in one call of under 10 minutes on one GPU machine:

    python -m bench gpu                 # needs CUDA
    python -m bench gpu --smoke         # CPU, gpt_nano, fp32: only proves the script runs

1. MFU, tokens/s and the loss after ``--steps`` steps of ``llama_1b`` shapes on one GPU in bf16, for
   each throughput lever (``VARIANTS``: eager, compiled, chunked loss, FP8 tensorwise and rowwise,
   selective and full activation checkpointing, fsdp2 at world 1, and the levers composed), on a
   learnable token stream so that losses can be compared (goal >= 45% MFU; FP8 faster than bf16
   at an equal loss). ``--budget`` starts no variant past that many seconds, so one call of a
   lent machine ends in time.
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


# (label, strategy, overrides): the levers of issue 43, each alone over compiled single, then
# composed; in the order a short call should measure them (--budget cuts the tail).
VARIANTS = [
    ("compile", "single", ["trainer.compile=true"]),
    ("compile+chunked-loss", "single", ["trainer.compile=true", "trainer.loss_chunk=4096"]),
    ("compile+fp8-tensorwise", "single", ["trainer.compile=true", "trainer.float8=tensorwise"]),
    ("compile+selective-ac", "single", ["trainer.compile=true", "strategy.activation_checkpointing=selective"]),
    ("eager", "single", ["trainer.compile=false"]),
    ("compile+chunked-loss+fp8-tensorwise", "single",
     ["trainer.compile=true", "trainer.loss_chunk=4096", "trainer.float8=tensorwise"]),
    ("compile+fp8-rowwise", "single", ["trainer.compile=true", "trainer.float8=rowwise"]),
    ("compile+full-ac", "single", ["trainer.compile=true", "strategy.activation_checkpointing=true"]),
    ("compile", "fsdp2", ["trainer.compile=true"]),
]
CPU_VARIANTS = ("eager", "compile+chunked-loss", "compile+selective-ac")
"""Smoke mode (CPU): these, with compile off (inductor on CPU needs minutes of C++ builds)."""


def learnable_tokens(path: Path, samples: int, seq_len: int, vocab: int, seed: int = 0) -> Path:
    """A token file a model can learn within tens of steps (random tokens cannot: their loss is
    ln(vocab) from the start): a Markov chain over 4096 ids where the next id is a fixed
    permutation of the current one 9 times in 10, uniform otherwise. uint32 (llama's vocabulary
    is larger than uint16)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = min(4096, vocab)
    step = rng.permutation(ids)
    n = samples * (seq_len + 1)
    noise, jumps = rng.random(n) < 0.1, rng.integers(0, ids, n)
    out, cur = np.empty(n, dtype=np.uint32), 0
    for i in range(n):  # (a few hundred thousand ids: a second)
        cur = jumps[i] if noise[i] else step[cur]
        out[i] = cur
    out.tofile(path)
    return path


def _row(label: str, strategy: str, report: dict | None, err: str) -> str:
    if report is None:
        said = [ln for ln in err.strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
        return f"| {strategy} | {label} | failed: {said[-1][:160] if said else '?'} |" + " |" * 8
    tp = report["throughput"]
    rank = report["memory"]["ranks"][0]
    peak = max((p["allocated"] for p in rank.get("cuda", {}).values()), default=0)
    pred = report["memory"].get("predicted", {}).get("total", 0)
    mfu = f"{100 * tp['mfu']:.1f}%" if tp.get("mfu") else "–"
    ratio = f"{peak / pred:.2f}" if peak and pred else "–"
    impl = (report.get("optimizer") or {}).get("impl", "–")
    attn = (report.get("attention") or {}).get("kernel", "–")
    first = report.get("startup", {}).get("total")
    first = f"{first:.0f} s" if first is not None else "–"
    return (f"| {strategy} | {label} | {tp['tokens_per_second']:.0f} | {mfu} | {tp['tflops_per_second']:.1f} | "
            f"{report['final_loss']:.4f} | {peak / 2**30:.2f} GiB | {pred / 2**30:.2f} GiB | {ratio} | "
            f"{impl} / {attn} | {first} |")


def _mfu_rows(a: argparse.Namespace, cluster: list[str], tmp: Path) -> list[str]:
    import time

    lines = ["| strategy | variant | tokens/s | MFU | TFLOP/s | final loss | peak allocated | planner | "
             "measured / planner | optimizer / attention | first step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    data = learnable_tokens(tmp / "tokens.bin", a.micro * a.steps, 2048 if not a.smoke else 64,
                            128256 if not a.smoke else 256)
    picked = [v for v in VARIANTS if f"{v[1]}:{v[0]}" in a.variants or v[0] in a.variants or "all" in a.variants]
    t0, last = time.monotonic(), 0.0
    for label, strategy, extra in picked:
        if a.smoke:
            if label not in CPU_VARIANTS:
                continue
            extra = [x for x in extra if x != "trainer.compile=true"]
        if a.budget and time.monotonic() - t0 + last > a.budget:
            lines.append(f"| {strategy} | {label} | skipped: the call's budget ({a.budget:.0f} s) |" + " |" * 8)
            continue
        t1 = time.monotonic()
        report, _, err = common.train(
            [f"strategy={strategy}", f"model={a.model}", "data=tokens", f"data.path={data}", "data.dtype=uint32",
             *cluster, f"trainer.precision={a.precision}", f"trainer.max_steps={a.steps}",
             f"trainer.global_batch_size={a.micro}", f"trainer.micro_batch_size={a.micro}",
             f"trainer.warmup_steps={min(10, a.steps // 3)}", "trainer.grad_clip=1.0", "trainer.lr=3e-4",
             "planner.enforce=false", "callbacks.communication=false",
             "callbacks.plots=false", *extra] + (["model.seq_len=64"] if a.smoke else []),
            tmp / f"{strategy}-{label}", timeout=a.timeout, threads=4)
        last = time.monotonic() - t1
        lines.append(_row(label, strategy, report, err))
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
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--timeout", type=float, default=180, help="seconds per variant run")
    p.add_argument("--variants", nargs="+", default=["all"],
                   help="labels (e.g. compile), strategy:label (fsdp2:compile) or all")
    p.add_argument("--budget", type=float, default=0, help="start no variant past this many seconds (0: none)")
    p.add_argument("--no-ladder", action="store_true", help="skip the zero3_offload ladder")
    p.add_argument("--ladder", nargs="+", default=LADDER)
    p.add_argument("--offload-steps", type=int, default=3)
    p.add_argument("--offload-timeout", type=float, default=300)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.model, a.precision, a.micro, a.steps, a.ladder, a.offload_steps = "gpt_nano", "32", 2, 3, ["gpt_nano"], 1
        a.timeout = a.offload_timeout = 600  # a loaded CPU machine, not a GPU's budget
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("python -m bench gpu needs CUDA (use --smoke to check the script on CPU)")
    cluster = _cluster(a.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        rows = _mfu_rows(a, cluster, Path(tmp))
        largest = [] if a.no_ladder else _largest(a, cluster, Path(tmp))
    notes = (f"`{a.model}` shapes, {a.precision}, micro batch {a.micro} (world 1), {a.steps} steps on a "
             "learnable token stream (`learnable_tokens`), lr 3e-4 after min(10, steps/3) warm-up steps, clipped at 1.0; median step (first excluded); "
             "communication observer off. MFU = model FLOPs / the GPU's dense peak (observers/throughput.py); "
             "first step = command to first optimizer step (compile warm-up included). Goals (issues 15, 43): "
             ">= 45% MFU, FP8 faster than bf16 at an equal loss, peak memory within +-10% of the planner, "
             "zero3_offload >= 7B parameters.")
    common.emit("gpu", common.command_line(), notes, "\n".join(rows) + "\n\n" + "\n".join(largest), smoke=a.smoke)
