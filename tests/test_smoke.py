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
    "ddp_topk": TWO,
}
# Accelerate refuses these before launch, by name (backends.check; tests/test_accelerate.py).
ACCELERATE_REFUSES = {"tp", "pipeline", "fsdp_cp", "fsdp_ep"}
CASES = [(p, b) for b in ("lightning", "accelerate") for p in FAMILIES
         if not (b == "accelerate" and p in ACCELERATE_REFUSES)]

pytestmark = [pytest.mark.smoke, pytest.mark.multiprocess, pytest.mark.timeout(420)]


@pytest.mark.parametrize("preset, backend", CASES)
def test_family_trains_with_every_other_setting_at_its_default(tmp_path, preset, backend):
    run = run_cli("train.py", f"strategy={preset}", f"backend={backend}", *FAMILIES[preset],
                  "trainer.max_steps=2", out=tmp_path, timeout=360)
    losses = run.losses
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    comm = run.report["communication"]
    assert comm["steps"] == 2 and not comm.get("unobserved"), comm
    if FAMILIES[preset]:  # more than one process: their collectives were seen
        assert comm["per_step"], comm
