"""Mixture of experts vs the expert-parallel degree: gpt_moe_nano on 1, 2 and 4 CPU ranks
(single, fsdp_ep ep=2, fsdp_ep ep=4), at two capacity factors: the assignments each expert took
and the ones dropped per step, the all-to-all each rank sent on the ep group (measured by the
communication profile) next to the planner's prediction.

``python -m bench moe`` (writes BENCHMARKS.md); ``--smoke``: the planner's numbers only, no
training, nothing written.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.common import command_line, emit, train

CASES = [  # (preset, devices, ep)
    ("single", 1, 1),
    ("fsdp_ep", 2, 2),
    ("fsdp_ep", 4, 4),
]
FACTORS = (2.0, 1.0)
BASE = ["model=gpt_moe_nano", "cluster.accelerator=cpu", "trainer.precision=32", "trainer.max_steps=6",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.save_last=false",
        "planner.enforce=false", "callbacks.plots=false", "cluster.oversubscribe=true"]


def _overrides(preset: str, devices: int, ep: int, factor: float) -> list[str]:
    out = [*BASE, f"strategy={preset}", f"cluster.devices={devices}", f"model.capacity_factor={factor}"]
    return out + ([f"strategy.ep={ep}"] if preset != "single" else [])


def _planned(overrides: list[str]) -> float:
    from planner import plan_dict, preflight
    from recipes.config import compose
    from recipes.job import CONFIG, validate

    comm = plan_dict(preflight(validate(compose(overrides), depth=CONFIG)))["communication"]["by_collective"]
    return comm.get("moe_all_to_all", {}).get("bytes", 0.0)


def main(argv: list[str]) -> None:
    smoke = "--smoke" in argv
    rows = ["| preset | ep | capacity factor | assignments per expert per step (layer 0) | dropped per step "
            "(fraction) | all-to-alls per step | sent per rank, measured | planned | ratio | step s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for factor in FACTORS:
            for preset, devices, ep in CASES:
                ov = _overrides(preset, devices, ep, factor)
                planned = _planned(ov)
                if smoke:
                    rows.append(f"| {preset} | {ep} | {factor:g} | – | – | – | – | {planned:,.0f} | – | – |")
                    continue
                out = Path(tmp) / f"{preset}-{ep}-{factor}"
                report, _wall, err = train(ov, out)
                if report is None:
                    print(f"# {preset} ep={ep}: failed\n{err}", file=sys.stderr)
                    continue
                moe = report["moe"]
                a2a = report["communication"]["by_group"].get("ep", {}).get("all_to_all", {})
                sent = a2a.get("wire_bytes", 0.0)
                tokens = ", ".join(f"{x:.0f}" for x in moe["tokens_per_expert"][0])
                ratio = f"{sent / planned:.3f}" if planned else "–"
                rows.append(f"| {preset} | {ep} | {factor:g} | {tokens} | {moe['dropped_tokens']:.0f} "
                            f"({moe['dropped_fraction']:.1%}) | {a2a.get('count', 0):.0f} | {sent:,.0f} B | "
                            f"{planned:,.0f} B | {ratio} | {report['throughput']['step_seconds']:.3f} |")
    notes = ("gpt_moe_nano (4 experts, top-2, 2 MoE layers, seq 32), global batch 8, micro batch 2, "
             "fp32, 6 steps (the first excluded from per-step averages); routing and capacity per "
             "sequence, so the assignments and drops are the same at every ep; the all-to-all "
             "carries the capacity-padded buffer (n_experts x micro x capacity x dim), so its bytes "
             "follow the capacity factor, not the routing.")
    emit("moe", command_line(), notes, "\n".join(rows), smoke=smoke)


if __name__ == "__main__":
    main(sys.argv[1:])
