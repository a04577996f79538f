"""Predicted next to measured: the planner's figures for this preset, model, batch and world
beside what rank 0 measured. Report key ``predicted_vs_measured``: for ``state_bytes`` (params,
grads, optimizer state incl. fp32 master, wherever they live but NVMe), ``activations`` (one
micro-batch's saved tensors) and ``communication`` (bytes this rank sends per optimizer step on a
ring: the planner's unit), ``{"predicted", "measured", "ratio"}`` (ratio = measured / predicted).
"""

from __future__ import annotations

from typing import Any

from observers.base import Observer


def _row(predicted: float | None, measured: float | None) -> dict[str, Any]:
    ratio = measured / predicted if predicted and measured is not None else None
    return {"predicted": predicted, "measured": measured, "ratio": ratio}


def predicted_state_bytes(memory: dict[str, int]) -> int:
    return (memory["params"] + memory["grads"] + memory["master"] + memory["optimizer"]
            + memory["host"])


class Comparison(Observer):
    """Reads the memory and communication observers' results (whichever are on)."""

    def __init__(self, plan: dict[str, Any], memory: Any = None, communication: Any = None):
        self.plan, self.memory, self.communication = plan, memory, communication

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        mem = self.plan["memory"]
        if self.memory is not None and self.memory.ranks:
            r0 = self.memory.ranks[0]
            held = sum(r0.get(k, 0) for k in ("params", "grads", "optimizer"))
            out["state_bytes"] = _row(predicted_state_bytes(mem), held)
            out["activations"] = _row(mem["activations"], r0.get("activations"))
        if self.communication is not None and self.communication.steps:
            sent = sum(v["wire_bytes"] for v in self.communication.per_step().values())
            out["communication"] = _row(self.plan["communication"]["bytes_per_step"], sent)
        return {"predicted_vs_measured": out}


def summary_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The comparison as a small table, for the end-of-run log."""
    def mib(x: float | None) -> str:
        return f"{x / 2**20:,.2f} MiB" if x is not None else "-"

    lines = [f"{'':>14} {'predicted':>14} {'measured':>14} {'ratio':>7}"]
    for name, r in rows.items():
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        lines.append(f"{name:>14} {mib(r['predicted']):>14} {mib(r['measured']):>14} {ratio:>7}")
    return lines
