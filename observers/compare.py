"""Predicted next to measured: the planner's figures for this preset, model, batch and world
beside what was measured. Report key ``predicted_vs_measured``: for ``state_bytes`` (params,
grads, optimizer state incl. fp32 master, wherever they live but NVMe; rank 0), ``activations``
(the most saved tensors any rank held at once in its first micro-batch's forward -- a
pipeline's whole first schedule -- against the planner's busiest device), on a Linux host
``step_growth`` (how far a step's RSS rises above what its update leaves -- activations, the loss
backward, gathered units -- against the plan's ``memory.growth``; the largest rank; no ratio when
the run measured its first step alone, whose update creates the optimizer state) and ``peak``
(the step's RSS above the process before the model was built against ``memory.total``, with
offload ``+ memory.host`` at the busier phase -- the optimizer's step temporaries beside
``memory.step``, not the activations: strategies/footprint.py ``cpu_peak``; the runtime's own
memory is not planned); on CUDA ``peak`` is the allocator's peak against
``memory.total`` and ``host`` the RSS against ``memory.host`` (each row's ``of`` says which),
``communication``
(bytes the busiest rank sends per optimizer step on a ring: the planner's unit; offload's
host and NVMe copies are not collectives and are left out of the prediction; measured after the
preset's warm-up -- PowerSGD's, top-k's, int8's, local SGD's and DiLoCo's plain all-reduce steps
--, under local SGD and DiLoCo over whole ``sync_every`` periods ending at the last step: the
steady state the plan prices, which ``of`` says; a run that never left its warm-up, or measured
less than one period after it, has ``steady_state: false`` and no ratio) and
``step_seconds`` (the planner's step time against the throughput observer's median step, the
first excluded; planned from the nominal cluster.peak_tflops x planner.mfu rather than this
machine's measured matmul rate, it is marked ``calibrated: false`` and has no ratio: "not
calibrated" is all such a ratio would say), ``{"predicted", "measured", "ratio"}`` (ratio =
measured / predicted; a row without one where there is a reason carries ``no_ratio``, the word the
table shows, and ``of`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from observers.base import Observer, Selection, observer


def _row(predicted: float | None, measured: float | None) -> dict[str, Any]:
    ratio = measured / predicted if predicted and measured is not None else None
    return {"predicted": predicted, "measured": measured, "ratio": ratio}


def predicted_state_bytes(memory: dict[str, Any]) -> int:
    """The model states wherever they live but NVMe: on the host, the host items that are
    states (strategies.footprint.HOST_STATES), not the engine's staging copies and temporaries."""
    from strategies.footprint import HOST_STATES

    items = memory.get("host_items") or {}
    host = sum(items.get(k, 0) for k in HOST_STATES) if items else memory["host"]
    return memory["params"] + memory["grads"] + memory["master"] + memory["optimizer"] + host


def predicted_wire_bytes(communication: dict[str, Any]) -> float:
    """What the communication observer can measure of the plan's ``communication``: its
    collectives, not offload's host<->device or NVMe copies (their ``group``), which are memory
    copies no process group sees (zero3_offload's ratio read 0.33 with them)."""
    by = communication["by_collective"].values()
    return sum(x["bytes"] for x in by if x["group"] not in ("host", "nvme"))


def _steady(comm: Any) -> dict[str, Any]:
    """What the measured communication covers, beside the plan's steady state: the steps after
    the preset's warm-up (under local SGD and DiLoCo, whole sync periods of them); none past it,
    or fewer than one period: no ratio, and why (``no_ratio``: the table's word for it)."""
    from observers.comm_steps import PARTIAL, STEADY, first_whole

    if not comm.warmup and comm.period <= 1:
        return {}
    averaged, what = comm.averaged()
    warm = f"{comm.warmup_key}={comm.warmup}" if comm.warmup else ""
    after = f"after {warm} (the plain all-reduce warm-up)" if warm else "after the first step"
    need = first_whole(comm.steps.first_index or 0, comm.warmup, comm.period)
    sync = f"{comm.period_key}={comm.period}"
    if what == STEADY:
        whole = (f", {averaged // comm.period} whole {sync} period(s) ending at the last step"
                 if comm.period > 1 else "")
        return {"of": f"the {averaged} step(s) measured {after}{whole}: the steady state the plan prices"}
    if what == PARTIAL:
        return {"ratio": None, "steady_state": False, "no_ratio": "partial",
                "of": f"the {averaged} step(s) measured {after} are under one {sync} period, and the "
                      f"plan spreads one parameter all-reduce over each period's {comm.period} steps: no "
                      f"ratio (trainer.max_steps={need} or more measures a whole period)"}
    return {"ratio": None, "steady_state": False, "no_ratio": "warm-up",
            "of": f"every step measured was in the warm-up ({warm}: plain all-reduce), and the plan "
                  f"is the steady state after it: no ratio (trainer.max_steps above {comm.warmup} "
                  "measures it)"}


class Comparison(Observer):
    """Reads the memory and communication observers' results (whichever are on)."""

    def __init__(self, plan: dict[str, Any], memory: Any = None, communication: Any = None,
                 throughput: Any = None, checkpointed: bool | str = False):
        self.plan, self.memory, self.communication = plan, memory, communication
        self.throughput, self.checkpointed = throughput, checkpointed

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        mem = self.plan["memory"]
        if self.memory is not None and self.memory.ranks:
            r0 = self.memory.ranks[0]
            held = sum(r0.get(k, 0) for k in ("params", "grads", "optimizer"))
            out["state_bytes"] = _row(predicted_state_bytes(mem), held)
            saved = [r["activations"] for r in self.memory.ranks if r.get("activations") is not None]
            out["activations"] = _row(mem["activations"], max(saved) if saved else None)
            if self.checkpointed:  # (forward keeps the block inputs; the plan adds backward's recompute)
                out["activations"] |= {"ratio": None, "of": "forward's saved tensors; the plan adds the "
                                       "block activation checkpointing recomputes in backward, which "
                                       "forward does not hold: no ratio"}
            out.update(self._peaks(mem))
        if self.communication is not None and self.communication.steps.count:
            sent = sum(v["wire_bytes"] for v in self.communication.per_step().values())
            sent = max([sent, *(r["wire_bytes"] for r in self.communication.ranks or [])])
            out["communication"] = _row(predicted_wire_bytes(self.plan["communication"]), sent) \
                | _steady(self.communication)
        if self.throughput is not None and self.throughput.seconds and self.plan.get("step_seconds"):
            row = _row(self.plan["step_seconds"], self.throughput.step_seconds())
            source = (self.plan.get("compute") or {}).get("peak_source", "")
            if not source.startswith("matmul measured"):  # nominal peak x planner.mfu: no verdict
                row |= {"ratio": None, "calibrated": False}
            out["step_seconds"] = row
        return {"predicted_vs_measured": out}


    def _peaks(self, mem: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Each peak against what was planned for where it was measured (``of``): on CUDA the
        device's allocator peak against the device plan, and the host's RSS against the host
        plan (what offload moved there); on CPU the RSS against the device plan (the host is
        the device) and what offload moved, at the busier phase (``cpu_peak``). The host's RSS
        is never divided by a device figure."""
        grown = [r for r in self.memory.ranks if r.get("peak_rss_growth") is not None]
        cuda = [max((p.get("allocated", 0) for p in r.get("cuda", {}).values()), default=0)
                for r in self.memory.ranks]
        out: dict[str, dict[str, Any]] = {}
        if any(cuda):
            out["peak"] = {**_row(mem["total"], max(cuda)), "of": "device: CUDA max_memory_allocated"}
            if grown and mem.get("host"):
                out["host"] = {**_row(mem["host"], max(r["peak_rss_run"] for r in grown)),
                               "of": "host: RSS above the process before the model was built"}
        elif grown and "growth" in mem:
            out["step_growth"] = {**_row(mem["growth"], max(r["peak_rss_growth"] for r in grown)),
                                  "of": "device (the host): RSS above what a step's update leaves"}
            if getattr(self.memory, "first_step_only", False):
                out["step_growth"] |= {"ratio": None, "no_ratio": "1 step", "of": FIRST_STEP}
            # offload on a host: what it moved is in the same RSS, beside the "device", but the
            # step's temporaries only once the activations are gone (the planner's own rule)
            from strategies.footprint import STEP_ONLY, cpu_peak

            items, host = mem.get("host_items") or {}, mem.get("host", 0)
            against = "" if not host else (
                " against the busier of backward (memory.total + memory.host less the step's "
                "temporaries) and the step (memory.step + memory.host)"
                if any(items.get(k) for k in STEP_ONLY) else " against memory.total + memory.host")
            planned = cpu_peak(mem["total"], mem.get("step", 0), host, items)
            out["peak"] = {**_row(planned, max(r["peak_rss_run"] for r in grown)),
                           "of": "device (the host): RSS above the process before the model was "
                                 f"built{against}"}
            if runtime := (mem.get("host_items") or {}).get("engine_runtime"):  # (offloaded DeepSpeed's)
                out["peak"]["engine_runtime"] = runtime
        return out


FIRST_STEP = ("device (the host): RSS above what the first step's update leaves, the only step this run "
              "measured: that update creates the optimizer state, which the RSS after it holds and the "
              "step's peak did not, so the growth reads low: no ratio (trainer.max_steps=2 or more "
              "measures a later step)")


def sweep_facts(report: dict[str, Any]) -> dict[str, Any]:
    """A sweep row's rates (launchers/sweep.py), each with what it is: tokens/s at the median step,
    or the whole loop's (first step included) when the throughput observer was off
    (``tokens_per_second_of``); what rank 0 sends per step on a ring, the planner's unit, after
    the preset's warm-up as this comparison reads it (``comm_of``: what the average is, the
    communication report's ``averaged_of``: "steady state", the steady state the plan prices, or
    "warm-up" when the run never left it, or "part of a sync period")."""
    comm, throughput = report.get("communication") or {}, report.get("throughput") or {}
    per, median = comm.get("per_step") or {}, "tokens_per_second" in throughput
    return {"tokens_per_second": throughput["tokens_per_second"] if median else report.get("tokens_per_second"),
            "tokens_per_second_of": "median step" if median else "whole loop",
            "comm_bytes_per_step": sum(v["wire_bytes"] for v in per.values()) if per else None,
            "comm_of": comm.get("averaged_of") or ("warm-up" if comm.get("steady_state") is False
                                                    else "steady state")}


SMALL_PEAK = 64 << 20
"""Below this planned peak the table says the ratio is the runtime's, not the plan's."""


def summary_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The comparison as a small table, for the end-of-run log."""
    def unit(name: str, x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:,.3f} s" if name.endswith("seconds") else f"{x / 2**20:,.2f} MiB"

    lines = [f"{'':>14} {'predicted':>14} {'measured':>14} {'ratio':>7}"]
    for name, r in rows.items():
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        if r.get("calibrated") is False:
            ratio = "uncal."
        ratio = r.get("no_ratio") or ratio
        lines.append(f"{name:>14} {unit(name, r['predicted']):>14} {unit(name, r['measured']):>14} {ratio:>7}")
    why = [f"{'':>14} {r['no_ratio']}: {r['of']}" for r in rows.values() if r.get("no_ratio")]
    return lines + [f"{'':>14} {note}" for name, note in LEGEND.items() if _shown(name, rows)] + why


LEGEND = {
    "communication": "communication: MiB the busiest rank sends per optimizer step on a ring (the plan's "
                     "unit; communication.png plots each collective's payload)",
    "peak": f"peak: a plan under {SMALL_PEAK >> 20} MiB (DeepSpeed's fixed engine_runtime aside, which "
            "offload plans book) is mostly the allocator's and runtime's own memory, which no plan "
            "counts: a large ratio there says nothing of the layout",
    "step_seconds": "uncal.: step time planned from cluster.peak_tflops x planner.mfu, not this machine "
                    "(planner.calibrate=true measures it)",
    "activations": "activations: measured as forward's saved tensors; under activation checkpointing the "
                   "plan adds the block recomputed in backward, so no ratio",
}


def _shown(name: str, rows: dict[str, dict[str, Any]]) -> bool:
    r = rows.get(name)
    if r is None:
        return False
    if name == "peak":  # (the same threshold with and without offload's fixed engine_runtime)
        return (r.get("predicted") or 0) - r.get("engine_runtime", 0) < SMALL_PEAK
    if name == "communication":  # (one process sends nothing, and has no communication.png)
        return bool(r.get("measured"))
    if name == "activations":
        return "of" in r
    return name != "step_seconds" or r.get("calibrated") is False


@dataclass
class CompareKnobs:
    compare: bool = True
    """The planner's prediction next to what was measured (state, activations, communication)."""


@observer("compare", order=70, knobs=CompareKnobs)
def _selected(s: Selection) -> Observer | None:
    """``callbacks.compare``, when the run was planned: beside the memory, communication and
    throughput observers chosen before it."""
    if not (s.job.callbacks.compare and s.plan is not None):
        return None
    chosen = s.chosen.get
    return Comparison(s.plan, chosen("memory"), chosen("communication"), chosen("throughput"),
                      getattr(s.job.strategy, "activation_checkpointing", False))
