"""Every family trains with every other setting at its default, on both backends: a two-step run
of the default job (its model, batch, precision and observers) with only the strategy and the
processes it needs changed. CI runs these under each torch it proves (.ci/run's legs): a torch
that moved its internals shows here first -- the communication observer's registrations, FSDP2's
cast on recompute, torch's ring attention."""

from __future__ import annotations

import math

import pytest

from tests.conftest import run_cli

TWO = ("cluster.devices=2",)
FAMILIES = {
    "single": (), "ddp": TWO, "fsdp": TWO, "fsdp2": TWO, "zero2": TWO, "zero3": TWO, "tp": TWO,
    "pipeline": TWO, "ulysses": TWO, "fsdp_cp": TWO, "fsdp_ep": (*TWO, "model=gpt_moe_nano"),
    "zero2_ep": (*TWO, "model=gpt_moe_nano"), "ddp_topk": TWO,
    # fsdp2 with checkpointing under bf16: torch 2.11 skipped FSDP2's input cast on recompute
    # (parallel/parallelize.py _units); any model shows it, and gpt_small's bf16 matmuls on a CPU
    # took a minute of CI's second leg
    "fsdp2-ac-bf16": (*TWO, "strategy.activation_checkpointing=true", "trainer.precision=bf16-mixed",
                      "model=gpt_nano"),
}
# On Accelerate, one preset of each engine it builds (its own loop, its FSDP2 plugin, DeepSpeed,
# DDP with a compression hook): it refuses tp, pipeline, fsdp_cp, fsdp_ep and zero2_ep by name
# (backends.check; tests/test_accelerate.py), and its fsdp/zero2/ulysses builders share these
# engines' code paths (CI's time: every run here is a whole start-up).
ON_ACCELERATE = ("single", "fsdp2", "zero3", "ddp_topk")
CASES = [(p, "lightning") for p in FAMILIES] + [(p, "accelerate") for p in ON_ACCELERATE]

pytestmark = [pytest.mark.smoke, pytest.mark.multiprocess, pytest.mark.timeout(420)]


@pytest.mark.parametrize("preset, backend", CASES)
def test_family_trains_with_every_other_setting_at_its_default(tmp_path, preset, backend):
    run = run_cli("train.py", f"strategy={preset.split('-')[0]}", f"backend={backend}", *FAMILIES[preset],
                  "trainer.max_steps=2", out=tmp_path, timeout=360)
    losses = run.losses
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    comm = run.report["communication"]
    assert comm["steps"] == 2 and not comm.get("unobserved"), comm
    if FAMILIES[preset]:  # more than one process: their collectives were seen
        assert comm["per_step"], comm
