"""What our layer costs against a loop written by hand on the raw libraries.

    python -m bench overhead                  # gpt_small, 2 CPU processes, 3 repetitions
    python -m bench overhead --smoke          # seconds: gpt_nano, 2 steps, 1 repetition

For each family (ddp, fsdp2, zero2, zero3), each repetition runs the hand-written loop
(bench/handloop.py: DDP / fully_shard / deepspeed.initialize) and ``train.py strategy=<family>``
on each backend, alternating which side goes first; ratios are ours / hand per repetition, and
the table gives their median and spread. Ours runs with ``callbacks=none`` plus the throughput
observer (two clock reads per step) so step times exist, and without the final checkpoint
(``trainer.save_last=false``: the hand loop writes none); the hand loop allocates as our ranks
do. Then the observers: ``ddp`` on both backends with each observer on alone and with the
default set, against the same hand loop.

Two measures, both excluding start-up (process launch, imports, model build and wrapping):
- step: median step time, the first step excluded, from the first micro-batch in hand to the
  loss reduced (report.json -> throughput.step_seconds; the hand loop times the same span);
- loop: the whole training loop over the steps (report.json -> wall_seconds), which also
  counts what runs between steps (data loading, the engine's hooks) and the first step;
- CPU per step: rank 0's process CPU time over the same span as step (every thread's;
  report.json -> throughput.step_cpu_seconds): what the step cost the host, which other jobs on
  the machine move far less than they move the wall clock (a shared machine's measure).
Targets (issue 15): <= 1.03 without observers, <= 1.10 with them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench import common

FAMILIES = ["ddp", "fsdp2", "zero2", "zero3"]
BACKENDS = ["lightning", "accelerate"]
OBSERVERS = {"memory": ["callbacks.memory.enabled=true"], "communication": ["callbacks.communication=true"],
             "compare": ["callbacks.compare=true"], "plots": ["callbacks.plots=true"],
             "default (all)": ["callbacks=default", "callbacks.progress_bar=false"]}
BASE_OBS = ["callbacks=none", "callbacks.throughput=true"]


def _ours(family: str, backend: str, a: argparse.Namespace, out: Path, observers: list[str]) -> dict | None:
    report, _, err = common.train(
        [f"strategy={family}", f"backend={backend}", f"model={a.model}", "data=synthetic",
         f"cluster.devices={a.devices}", "cluster.accelerator=cpu", f"trainer.max_steps={a.steps}",
         f"trainer.global_batch_size={a.global_batch}", f"trainer.micro_batch_size={a.global_batch // a.devices}",
         "trainer.warmup_steps=0", "planner.enforce=false",
         "trainer.save_last=false",  # (the hand loop writes no checkpoint: not in its loop, not in ours)
         *observers], out, timeout=a.timeout)
    if report is None:
        print(f"# ours {family}/{backend}: failed\n{err}")
    return report


def _measures(report: dict) -> tuple[float, float, float]:
    t = report["throughput"]
    return t["step_seconds"], report["wall_seconds"] / report["steps"], t["step_cpu_seconds"]


def _same_losses(ours: dict, hand: dict) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(ours["losses"], hand["losses"]))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m bench overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=FAMILIES)
    p.add_argument("--backends", nargs="+", default=BACKENDS)
    p.add_argument("--observers", nargs="*", default=list(OBSERVERS), help="observer rows (ddp only)")
    p.add_argument("--model", default="gpt_small")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--print-only", action="store_true", help="print the table, leave BENCHMARKS.md alone")
    p.add_argument("--smoke", action="store_true", help="gpt_nano, 3 steps, 1 repetition, ddp on Lightning; no file written")
    a = p.parse_args(argv)
    if a.smoke:
        a.model, a.steps, a.reps, a.families, a.backends, a.observers = "gpt_nano", 3, 1, ["ddp"], ["lightning"], []

    # ratios[(family, backend, label)] = ([step], [loop], [CPU per step] ratios, [loss differences])
    ratios: dict[tuple[str, str, str], tuple[list, list, list, list]] = {}
    hand_steps: dict[str, list[float]] = {}
    rows = [(f, b, "none") for f in a.families for b in a.backends]
    rows += [("ddp", b, o) for o in a.observers for b in a.backends]
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for family in a.families:
                mine = [r for r in rows if r[0] == family]
                runs = [("hand", None)] + [("ours", r) for r in mine]
                if rep % 2:
                    runs = runs[::-1]  # alternate which side goes first
                got: dict = {}
                for i, (what, row) in enumerate(runs):
                    out = Path(tmp) / f"{rep}-{family}-{i}"
                    if what == "hand":
                        got["hand"] = common.hand(family, a.model, out, devices=a.devices, steps=a.steps,
                                                  global_batch=a.global_batch,
                                                  micro_batch=a.global_batch // a.devices, timeout=a.timeout)
                    else:
                        _, backend, obs = row
                        got[row] = _ours(family, backend, a, out, BASE_OBS + OBSERVERS.get(obs, []))
                hand = got.pop("hand")
                if hand is None:
                    continue
                hand_steps.setdefault(family, []).append(hand["step_seconds"])
                for row, report in got.items():
                    if report is None:
                        continue
                    step, loop, cpu = _measures(report)
                    s, lp, c, d = ratios.setdefault(row, ([], [], [], []))
                    s.append(step / hand["step_seconds"])
                    lp.append(loop / hand["loop_seconds"])
                    c.append(cpu / hand["step_cpu_seconds"])
                    d.append(_same_losses(report, hand))
                print(f"# repetition {rep + 1}/{a.reps} {family}: done", flush=True)

    lines = ["| family | backend | observers on | step time vs hand loop | whole loop vs hand loop | "
             "CPU per step vs hand loop | hand step (s) | max loss difference |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        family, backend, obs = row
        if row not in ratios:
            lines.append(f"| {family} | {backend} | {obs} | failed | | | | |")
            continue
        s, lp, c, d = ratios[row]
        hs = sorted(hand_steps.get(family, [0.0]))[len(hand_steps.get(family, [0.0])) // 2]
        lines.append(f"| {family} | {backend} | {obs} | {common.fmt_ratio(s)} | {common.fmt_ratio(lp)} | {common.fmt_ratio(c)} | "
                     f"{hs:.3f} | {max(d):.1e} |")
    notes = (f"{a.model}, {a.devices} CPU processes (gloo) x 1 thread, synthetic tokens, global batch "
             f"{a.global_batch}, fp32, AdamW, clip 1.0, {a.steps} steps, {a.reps} alternating repetitions. "
             "Ratio = ours / hand-written loop (bench/handloop.py) per repetition: median (min-max). "
             "step: median step, first excluded; whole loop: train start to end over the steps; CPU: "
             "rank 0's process CPU time over the step's span (every thread), median. "
             "'observers on': ours with that observer (besides the throughput clock) — the hand loop "
             "has none. Both sides allocate alike (the hand loop sets our ranks' glibc settings) and "
             "neither writes a checkpoint (ours: trainer.save_last=false). "
             "Target: <= 1.03 with none, <= 1.10 with observers.")
    common.emit("overhead", common.command_line(), notes, "\n".join(lines), smoke=a.smoke or a.print_only)
